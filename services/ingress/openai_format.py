"""OpenAI response bodies, SSE chunks and error responses built by the ingress (the streamed text itself comes
from :mod:`common.stages.detokenize`)."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import JSONResponse

from common.errors import PrismError


def error_body(exc: PrismError, trace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI-style error body, with ``prism_trace`` when the client asked for the trace."""
    body = exc.to_body()
    if trace is not None:
        body["prism_trace"] = trace
    return body


def error_response(
    exc: PrismError, trace: dict[str, Any] | None = None, extra: dict[str, str] | None = None
) -> JSONResponse:
    """:func:`error_body` as an HTTP response (with ``Retry-After`` when the error carries one, and ``extra``)."""
    headers = dict(extra or {})
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(error_body(exc, trace), status_code=exc.http_status, headers=headers)


def choice_body(
    index: int,
    message: dict[str, Any],
    finish: str,
    out_ids: list[int],
    with_ids: bool,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streaming answer."""
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "logprobs": logprobs_object(logprobs),
    }
    if with_ids:
        choice["token_ids"] = out_ids
    return choice


def logprobs_object(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` value (``None``: the request asks for none)."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], prompt_ids: list[int], completion_tokens: int, with_ids: bool
) -> dict[str, Any]:
    """A non-streaming answer of ``choices`` (:func:`choice_body`), ``completion_tokens`` in all of them."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_ids, completion_tokens),
    }
    if with_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def usage(prompt_ids: list[int], completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt_ids) + completion_tokens,
    }


def chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None = None,
    top: dict[str, Any] | None = None,
    **extra: Any,
) -> str:
    """One ``chat.completion.chunk`` event: ``extra`` goes into the choice (its ``index`` too, 0 unless given),
    ``top`` beside ``choices``."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    choice.update(extra)
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    body.update(top or {})
    return sse(body)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
