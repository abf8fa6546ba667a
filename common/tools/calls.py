"""Reading the model's answer for tool calls: text in, OpenAI ``content`` and ``tool_calls`` deltas out.

:class:`CallReader` reads the answer as it streams (the ingress pushes each detokenized delta) and returns the
chat-completion deltas to send: ``{"content": …}`` for text, and for each call first
``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}`` once its name is
known, then ``{"tool_calls": [{"index", "function": {"arguments": …}}]}`` as its arguments arrive — what OpenAI's SDK
accumulates. A non-streamed answer is the same reader over the whole text (:func:`read_answer`), so both carry the same
calls and the same content.

The format is the chat template's (:mod:`common.model.families.tool_format`): ``<tool_call>`` JSON ``</tool_call>``,
the JSON ``{"name": …, "arguments": {…}}``. The grammar makes it compact and in that key order; a call written
otherwise (unconstrained text, another key order) is still read once its closing tag arrives, and one that is not
JSON is given back as text. Text held back: a tail that could begin an opening tag, and whitespace before one (the
content of an answer that calls is its text before the first call, without trailing whitespace).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from common.tools.tags import TOOL_MARKERS

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False
    """Its closing tag was read (a call cut by ``max_tokens`` is not)."""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class _Arguments:
    """Where an arguments value ends: JSON nesting outside strings."""

    depth: int = 0
    started: bool = False
    in_string: bool = False
    escaped: bool = False

    def take(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (``len(text)`` while it goes on; fewer once it ended:
        the rest is after it)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # (a scalar value: the outer object's brace ends it)
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif ch == "," and self.depth == 0:
                return i
        return len(text)


@dataclass
class CallReader:
    """One answer's reader (see the module docstring); ``open``/``close``: the call tags."""

    open: str = TOOL_MARKERS[0]
    close: str = TOOL_MARKERS[1]
    names: frozenset[str] | None = None
    """The functions the request offers (``None``: any name): a call of another is text, not a call."""
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    """The text sent as content so far."""
    _state: str = "text"
    _buf: str = ""
    _args: _Arguments = field(default_factory=_Arguments)

    def push(self, text: str) -> list[dict[str, Any]]:
        """The deltas that ``text`` (the answer's next piece) completes."""
        self._buf += text
        out: list[dict[str, Any]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left at the end of the answer: held-back text, or a call head that never completed (as text)."""
        out: list[dict[str, Any]] = []
        if self._state == "text":
            self._text(self._buf, out)
        elif self._state == "head":
            self._text(self.open + self._buf, out)
        self._buf = ""
        return out

    @property
    def called(self) -> bool:
        """Whether the answer holds a complete call."""
        return any(c.complete for c in self.calls)

    def message(self) -> dict[str, Any]:
        """The assistant message of the whole answer: ``content`` (``None`` when it only calls) and ``tool_calls``."""
        if not self.calls:
            return {"role": "assistant", "content": self.content}
        calls = [c.as_openai() for c in self.calls]
        return {"role": "assistant", "content": self.content or None, "tool_calls": calls}

    # ---- states: text → head (after an opening tag) → args → tail (to the closing tag) → after ------------------
    def _step(self, out: list[dict[str, Any]]) -> bool:
        """Advance over the buffer once; whether another step may make progress."""
        if self._state in ("text", "after"):
            return self._outside(out)
        if self._state == "head":
            return self._head(out)
        if self._state == "args":
            return self._arguments(out)
        end = self._buf.find(self.close)  # tail: the call's closing brace and tag
        if end < 0:
            return False
        self.calls[-1].complete = True
        self._buf, self._state = self._buf[end + len(self.close) :], "after"
        return True

    def _outside(self, out: list[dict[str, Any]]) -> bool:
        """Text, or what follows a call: content up to the next opening tag (held back where one may begin)."""
        buf = self._buf
        at = buf.find(self.open)
        if at < 0:
            if self._state == "after":
                rest = buf.lstrip()
                if not rest or self.open.startswith(rest):
                    return False  # (whitespace between calls, or the start of the next tag)
                self._state = "text"  # text after the calls: content again
            keep = _held(buf, self.open)
            self._text(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
            return False
        if self._state == "text" or buf[:at].strip():
            self._text(buf[:at].rstrip(), out)
        self._buf, self._state = buf[at + len(self.open) :], "head"
        return True

    def _head(self, out: list[dict[str, Any]]) -> bool:
        """After an opening tag: the call starts once its name is read (in the grammar's form), or is read whole at
        its closing tag (another form), or is text (a function the request does not offer, a name that is not JSON)."""
        buf = self._buf
        head = _HEAD.match(buf)
        if head is not None:
            name = _string(head[1])
            if name is None or not self._offered(name):
                self._text(self.open + buf[: head.end()], out)
                self._buf, self._state = buf[head.end() :], "text"
                return True
            self._start(name, out)
            self._buf, self._state, self._args = buf[head.end() :], "args", _Arguments()
            return True
        end = buf.find(self.close)
        if end < 0:
            return False
        self._whole(buf[:end], out)
        self._buf, self._state = buf[end + len(self.close) :], "after"
        return True

    def _arguments(self, out: list[dict[str, Any]]) -> bool:
        """The call's arguments, sent as they arrive, to the end of their JSON value."""
        buf = self._buf
        taken = self._args.take(buf)
        if taken:
            self.calls[-1].arguments += buf[:taken]
            out.append(_args_delta(self.calls[-1], buf[:taken]))
        if taken == len(buf):
            self._buf = ""
            return False
        self._buf, self._state = buf[taken:], "tail"
        return True

    def _offered(self, name: str) -> bool:
        return self.names is None or name in self.names

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if text:
            self.content += text
            out.append({"content": text})

    def _start(self, name: str, out: list[dict[str, Any]]) -> None:
        call = ToolCall(index=len(self.calls), id=call_id(), name=name)
        self.calls.append(call)
        function = {"name": name, "arguments": ""}
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": function}]})

    def _whole(self, body: str, out: list[dict[str, Any]]) -> None:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        named = isinstance(value, dict) and isinstance(value.get("name"), str) and self._offered(value["name"])
        if not (named and "arguments" in value):
            self._text(self.open + body + self.close, out)
            return
        self._start(value["name"], out)
        args = value["arguments"]
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        self.calls[-1].arguments, self.calls[-1].complete = text, True
        out.append(_args_delta(self.calls[-1], text))


def _string(escaped: str) -> str | None:
    """A JSON string's body decoded (``None`` if it is not valid JSON: an unconstrained head may hold anything)."""
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:
        return None


def _args_delta(call: ToolCall, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": call.index, "function": {"arguments": text}}]}


def _held(buf: str, tag: str) -> int:
    """Characters at the end of ``buf`` to hold back: a tail that could begin ``tag``, and the whitespace before it."""
    keep = next((n for n in range(min(len(tag) - 1, len(buf)), 0, -1) if tag.startswith(buf[-n:])), 0)
    body = buf[: len(buf) - keep]
    return keep + (len(body) - len(body.rstrip()))


def read_answer(text: str, names: frozenset[str] | None = None) -> CallReader:
    """A whole answer read at once (what a non-streamed response carries); ``names``: the functions offered."""
    reader = CallReader(names=names)
    reader.push(text)
    reader.finish()
    return reader
