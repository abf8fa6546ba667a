"""The ingress's own bound on an HTTP request body — the second line behind Serve's proxy
(:mod:`services.platform.proxy_guard`).

Checked in the order the cost appears: ``Content-Type`` (415 unless JSON), the declared ``Content-Length`` (413
before reading), then the bytes as they arrive (413 at the limit, the rest never pulled from the proxy), then the JSON
— parsed in a worker thread, so a large body never stalls the replica's event loop — and its nesting depth.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from common.errors import RequestTooLarge, UnsupportedMediaType
from common.protocol.body import decode_json
from services.platform.memory import release_freed_memory


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise UnsupportedMediaType("request body must be JSON (Content-Type: application/json)", param="Content-Type")
    declared = request.headers.get("content-length", "").strip()
    if declared and (
        not declared.isascii() or not declared.isdigit() or len(declared) > 15 or int(declared) > max_bytes
    ):
        raise RequestTooLarge(f"request body is {declared} bytes; the limit is {max_bytes}")
    # One growing buffer rather than a list of chunks: past glibc's mmap threshold it lives in its own mapping, so
    # a refused body's memory goes back to the system at once instead of staying in the heap.
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            del body, chunk
            await asyncio.to_thread(release_freed_memory)
            raise RequestTooLarge(f"request body is over {max_bytes} bytes, the limit")
        body += chunk
    return await asyncio.to_thread(decode_json, body, max_depth)
