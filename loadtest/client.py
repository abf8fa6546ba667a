"""One streamed chat completion against any OpenAI-compatible endpoint, timed as the client sees it.

TTFT is the time to the first chunk carrying content; ITL is every gap between content chunks after that (one token
per chunk on Prism and most servers; a server that sends several tokens per chunk shows fewer, longer gaps); E2E ends
at ``[DONE]``. ``output_tokens`` comes from the final ``usage`` (the number of content chunks when a server sends
none). With ``trace=True`` the request carries ``X-Prism-Trace: 1`` and the record keeps Prism's ``prism_trace``.
A non-200 answer is recorded with its status and the OpenAI error ``code`` (``http_<status>`` when there is no body).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from loadtest.stats import RequestRecord


async def send(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    kind: str,
    sent_at: float,
    api_key: str | None = None,
    trace: bool = False,
    timeout_s: float = 120.0,
) -> RequestRecord:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if trace:
        headers["X-Prism-Trace"] = "1"
    record = RequestRecord(kind=kind, sent_at=sent_at, status=0, code="ok")
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.code = _error_code(await response.aread(), response.status_code)
                record.e2e_s = time.perf_counter() - start
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    record.status = 500
                    record.code = str(event["error"].get("code") or "stream_error")
                    break
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    chunks += 1
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                if event.get("usage"):
                    record.output_tokens = int(event["usage"].get("completion_tokens", 0))
                    record.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))
                if "prism_trace" in event:
                    record.trace = event["prism_trace"]
    except httpx.TimeoutException:
        record.status, record.code = 0, "client_timeout"
    except httpx.HTTPError as exc:
        record.status, record.code = 0, f"transport_{type(exc).__name__}"
    record.e2e_s = time.perf_counter() - start
    if record.status == 200 and not record.output_tokens:
        record.output_tokens = chunks
    return record


def _error_code(raw: bytes, status: int) -> str:
    try:
        return str(json.loads(raw)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"
