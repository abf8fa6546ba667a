"""The answer's text as OpenAI's message and deltas: plain content, or content and tool calls when the request lets
the model call (``tool_choice`` other than ``none``; the calls are read by :mod:`common.tools.calls`).

One :class:`AnswerStream` per streamed answer (HTTP's SSE, gRPC's stream): :meth:`AnswerStream.push` each
detokenized piece, :meth:`AnswerStream.end` with the last one and the decode's finish reason. A whole answer is
:func:`answer_message`. ``finish_reason`` becomes ``tool_calls`` when the answer stopped on its own after a complete
call (cut by ``max_tokens`` it stays ``length``, its last call's arguments partial, as OpenAI's are).
"""

from __future__ import annotations

import json
from typing import Any

from common.tools.calls import CallReader, read_answer
from common.tools.spec import ToolRequest


def _reads_calls(tools: ToolRequest | None) -> bool:
    return tools is not None and tools.calls_expected


def _names(tools: ToolRequest | None) -> frozenset[str] | None:
    return None if tools is None else frozenset(f.name for f in tools.functions)


def _finish(reader: CallReader, finish: str) -> str:
    return "tool_calls" if finish == "stop" and reader.called else finish


def answer_message(tools: ToolRequest | None, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a whole answer and its finish reason."""
    if not _reads_calls(tools):
        return {"role": "assistant", "content": text}, finish
    reader = read_answer(text, _names(tools))
    return reader.message(), _finish(reader, finish)


def calls_json(message: dict[str, Any]) -> str:
    """A message's ``tool_calls`` as JSON text (gRPC's field; empty when it has none)."""
    calls = message.get("tool_calls")
    return json.dumps(calls, separators=(",", ":")) if calls else ""


class AnswerStream:
    """A streamed answer's deltas (see the module docstring)."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self.reader = CallReader(names=_names(tools)) if _reads_calls(tools) else None

    def push(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send for the answer's next piece ``text`` (none, one or several)."""
        if self.reader is None:
            return [{"content": text}] if text else []
        return self.reader.push(text)

    def end(self, text: str, finish: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas (the final one is the delta of the chunk that carries the finish reason) and the finish
        reason to send."""
        if self.reader is None:
            return [{"content": text}], finish
        deltas = self.reader.push(text) + self.reader.finish()
        return [*deltas, {}], _finish(self.reader, finish)

    def message(self) -> dict[str, Any]:
        """The whole answer's message so far (gRPC's last chunk carries its calls)."""
        return self.reader.message() if self.reader is not None else {}
