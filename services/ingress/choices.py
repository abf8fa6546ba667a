"""The choices of one answer (``n`` ≥ 1): each choice's tokens turned into OpenAI's message, or its stream's pieces.

A whole answer (:meth:`services.ingress.call_stream.CallStream.collect`) gives every choice's tokens at once:
:func:`whole_choice` makes each one's message (stop strings cut, tool calls read), finish reason and log-probability
entries. A streamed answer keeps one :class:`ChoiceStream` per choice — its own detokenizer (stop strings are cut per
choice), tool-call reader and tokens — fed that choice's tokens as the decode stream interleaves them
(:meth:`ChoiceStream.push`) and closed by its finishing token (:meth:`ChoiceStream.end`). Each piece goes out with its
choice's ``index`` and the log-probabilities of the tokens whose text it carries (a token whose text is held back —
a possible stop string, a call's tag — reports with the piece that carries it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.stages.detokenize import Detokenizer
from common.stages.logprobs import entries
from common.stages.stops import visible_text
from services.ingress.answer import AnswerStream, answer_message
from services.ingress.call_stream import Call
from services.ingress.openai_format import logprobs_object

Piece = tuple[dict[str, Any], dict[str, Any]]
"""A streamed piece: its ``delta``, and the fields of its choice (``index``, ``logprobs``, ``token_ids``)."""


def logprob_entries(call: Call, index: int, out_ids: list[int], start: int) -> list[dict[str, Any]] | None:
    """The ``logprobs.content`` entries of choice ``index``'s tokens ``out_ids[start:]`` (``None`` when the request
    asks for none)."""
    if call.sampling.logprobs is None:
        return None
    return entries(call.frontend.token_bytes, out_ids[start:], call.logprobs[index][start : len(out_ids)])


def choice_logprobs(logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A streamed choice's ``logprobs`` field (left at the chunk's ``null`` when the request asks for none)."""
    return {} if logprobs is None else {"logprobs": logprobs_object(logprobs)}


def as_json(value: Any) -> str:
    """gRPC's JSON text fields: compact, empty for ``None``."""
    return "" if value is None else json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class WholeChoice:
    index: int
    message: dict[str, Any]
    finish: str
    out_ids: list[int]
    logprobs: list[dict[str, Any]] | None


def whole_choice(call: Call, index: int, out_ids: list[int], finish: str) -> WholeChoice:
    """Choice ``index`` of a non-streamed answer, from all its tokens and the decode's finish reason."""
    text = visible_text(call.frontend.tokenizer, out_ids, call.sampling)
    message, finish = answer_message(call.req.tool_request, text, finish)
    return WholeChoice(index, message, finish, out_ids, logprob_entries(call, index, out_ids, 0))


class ChoiceStream:
    """One choice of a streamed answer (see the module docstring)."""

    def __init__(self, call: Call, index: int) -> None:
        self.call = call
        self.index = index
        self.detok = Detokenizer(call.frontend.tokenizer, call.sampling.stop)
        self.answer = AnswerStream(call.req.tool_request)
        self.out_ids: list[int] = []
        self.reported = 0
        """Tokens whose log-probabilities went out (with the piece that carried their text, or a later one)."""

    def push(self, token: int) -> list[Piece]:
        """The pieces a token that does not finish the choice lets out (none, one or several)."""
        self.out_ids.append(token)
        return [self._piece(delta) for delta in self.answer.push(self.detok.push(token))]

    def end(self, token: int, finish: str) -> tuple[list[Piece], str]:
        """The last pieces of the choice, ending with its finishing token (the final piece is the one that carries the
        finish reason, and ``token_ids`` when the request asks for them), and the finish reason to send."""
        self.out_ids.append(token)
        deltas, reason = self.answer.end(self.detok.push(token) + self.detok.finish(), finish)
        pieces = [self._piece(delta) for delta in deltas]
        if self.call.req.return_token_ids:
            pieces[-1][1]["token_ids"] = self.out_ids
        return pieces, reason

    def _piece(self, delta: dict[str, Any]) -> Piece:
        logprobs = logprob_entries(self.call, self.index, self.out_ids, self.reported)
        self.reported = len(self.out_ids)
        return delta, {"index": self.index, **choice_logprobs(logprobs)}
