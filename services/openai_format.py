"""OpenAI response bodies, SSE chunks and error responses built by the ingress.

Also the incremental detokenizer: each streamed chunk carries the text that became *final* since the last one —
text ending in an incomplete UTF-8 sequence, and the tail that could still turn into a stop string, are held back
until the next token or the end.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import JSONResponse

from common.errors import Overloaded, PrismError
from common.protocol.sampling import SamplingParams
from common.stages.stops import visible_text


class Detokenizer:
    def __init__(self, tokenizer: Any, sampling: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.hold = max((len(s) for s in sampling.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def text(self) -> str:
        return visible_text(self.tokenizer, self.ids, self.sampling)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.text()
        final = len(text) - self.hold
        while final > self.sent and text[final - 1] == "\ufffd":
            final -= 1
        return self._advance(text, final)

    def finish(self) -> str:
        text = self.text()
        return self._advance(text, len(text))

    def _advance(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent : upto], upto
        return delta


def error_body(exc: PrismError, trace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI-style error body, with ``prism_trace`` when the client asked for the trace."""
    body = exc.to_body()
    if trace is not None:
        body["prism_trace"] = trace
    return body


def error_response(exc: PrismError, trace: dict[str, Any] | None = None) -> JSONResponse:
    """:func:`error_body` as an HTTP response (with ``Retry-After`` when the error carries one)."""
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(error_body(exc, trace), status_code=exc.http_status, headers=headers)


def completion_body(
    rid: str, model: str, text: str, finish: str, prompt_ids: list[int], out_ids: list[int], with_ids: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "logprobs": None,
    }
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_ids, out_ids),
    }
    if with_ids:
        choice["token_ids"] = out_ids
        body["prompt_token_ids"] = prompt_ids
    return body


def usage(prompt_ids: list[int], out_ids: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(out_ids),
        "total_tokens": len(prompt_ids) + len(out_ids),
    }


def chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None, **extra) -> str:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    choice.update(extra)
    return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]})


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
