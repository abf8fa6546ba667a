"""The ingress's own bound on an HTTP request body — the second line behind Serve's proxy
(:mod:`services.platform.proxy_guard`) — and on the body bytes one ingress replica holds at once.

Checked in the order the cost appears: ``Content-Type`` (415 unless JSON), the declared ``Content-Length`` (413
before reading), room for it among the replica's body bytes in flight (:class:`BodyBytes`: 429 before reading), then
the bytes as they arrive (413 at the limit, the rest never pulled from the proxy), then the JSON
(:func:`common.protocol.body.decode_json`: its width counted before it is parsed, its depth and Unicode after) —
parsed in a worker thread. The body's bytes count until it is parsed, however the read ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from common.admission.budget import BudgetGate
from common.admission.protocol import Grant
from common.config import ServerConfig
from common.errors import PrismError, RequestTooLarge, UnsupportedMediaType
from common.protocol.body import ascii_int, decode_json
from services.platform.memory import release_freed_memory

INLINE_BYTES = 4096
"""Bodies smaller than this are parsed (and planned) on the event loop: it costs them ~0.1 ms, where a worker thread
would queue them behind every large body being parsed — the default pool has a few threads, and a burst of requests
takes them all."""

T = TypeVar("T")

TRIM_AFTER_BYTES = 8 << 20
"""A refused body larger than this has its freed memory handed back to the system (``malloc_trim``: milliseconds)."""


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` for a body of ``size`` bytes: on the event loop when it is small (:data:`INLINE_BYTES`), else in a
    worker thread."""
    if size < INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class BodyBytes:
    """The body bytes an ingress replica holds at once, over every request being read or parsed: a body that would go
    past ``capacity`` is refused 429 ``server_overloaded`` (Retry-After from how fast bodies have been drained)
    before a byte of it is read — nothing waits here (a gate with no queue)."""

    def __init__(self, capacity: int, retry_after_s: float) -> None:
        self.gate = BudgetGate("ingress", "body bytes", capacity, max_waiting=0, retry_after_s=retry_after_s)

    async def take(self, nbytes: int) -> Grant:
        return await self.gate.acquire(nbytes, time.monotonic() + 60.0, time.monotonic())

    def give_back(self, grants: list[Grant]) -> None:
        for grant in grants:
            self.gate.release(grant)

    @property
    def held(self) -> int:
        return self.gate.used


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def read_json(request: Request, server: ServerConfig, max_bytes: int, budget: BodyBytes) -> tuple[Any, int]:
    """The request's JSON body (see the module docstring) and its size in bytes."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise UnsupportedMediaType("request body must be JSON (Content-Type: application/json)", param="Content-Type")
    raw_length = request.headers.get("content-length", "").strip() or None
    declared = ascii_int(raw_length) if raw_length is not None else None
    if raw_length is not None and (declared is None or declared > max_bytes):
        raise RequestTooLarge(f"request body is {raw_length[:20]} bytes; the limit is {max_bytes}")
    grants = [await budget.take(declared)] if declared else []
    try:
        body = await _read(request, max_bytes, budget, grants, counted=declared is not None)
        try:
            parsed = await off_loop(len(body), decode_json, body, server.max_json_depth, server.json_structure_limit)
            return parsed, len(body)
        except PrismError:
            if len(body) > TRIM_AFTER_BYTES:  # a large refused body: its buffers' memory back to the system now
                del body
                await asyncio.to_thread(release_freed_memory)
            raise
    finally:
        budget.give_back(grants)


async def _read(request: Request, max_bytes: int, budget: BodyBytes, grants: list[Grant], counted: bool) -> bytearray:
    """The body's bytes up to ``max_bytes``; a body that declared no length takes room as its chunks arrive."""
    # One growing buffer rather than a list of chunks: past glibc's mmap threshold it lives in its own mapping, so
    # a refused body's memory goes back to the system at once instead of staying in the heap.
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > max_bytes:
            del body, chunk
            await asyncio.to_thread(release_freed_memory)
            raise RequestTooLarge(f"request body is over {max_bytes} bytes, the limit")
        if not counted and chunk:
            grants.append(await budget.take(len(chunk)))
        body += chunk
    return body
