"""One request's life in the ingress, the same for every entry point (HTTP unary/SSE, gRPC unary/stream).

```
open ──enter──► admitted (holds an in-flight place) ──► working ──close──► OK | REFUSED | FAILED | CANCELLED
   └─ at capacity: closed REFUSED (429) at once, never admitted
```

:class:`RequestLifecycle` is an async context manager. Entering takes an in-flight place (or closes the request as a
429 and raises). Leaving closes it — by the exception that left the block (a typed error → REFUSED or FAILED by its
status, a cancellation → CANCELLED), or as OK. :meth:`RequestLifecycle.close` is the only place that finishes the
request's trace (metrics + the request log line), cancels its stage chain, gives back what the request holds
(:meth:`RequestLifecycle.hold`: its tenant's quota place, taken before the body was read) and its in-flight place; a
closed lifecycle ignores later closes, so the first outcome is the one recorded. An SSE response outlives its handler:
:meth:`detach` hands the open lifecycle to the response, which closes it itself — as CANCELLED if its body never ran.

Every 5xx is logged with its traceback: ids, codes, exception types and frames, never request content.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

from common.errors import Overloaded, PrismError
from common.obs.request_trace import RequestTrace
from services.ingress.failures import CANCELLED, CANCELLED_STATUS, log_failure, typed_error
from services.ingress.observer import RequestObserver


class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"
    """A typed 4xx (429 included): the client's request, or its timing, was refused."""
    FAILED = "failed"
    """A 5xx: a stage fault, a deadline, or a bug (logged with the traceback)."""
    CANCELLED = "cancelled"
    """The client went away before an answer."""


class InFlight:
    """An ingress replica's places: at most ``limit`` requests at once; more are refused with 429."""

    def __init__(self, limit: int, retry_after_s: float, on_change: Callable[[int], None]) -> None:
        self.limit, self.retry_after_s, self.on_change = limit, retry_after_s, on_change
        self.count = 0

    def acquire(self) -> None:
        if self.count >= self.limit:
            raise Overloaded("the server is at capacity; retry later", retry_after_s=self.retry_after_s)
        self.count += 1
        self.on_change(self.count)

    def release(self) -> None:
        self.count -= 1
        self.on_change(self.count)


class RequestLifecycle:
    def __init__(
        self, observer: RequestObserver, places: InFlight, protocol: str, traced: bool, traceparent: str | None = None
    ) -> None:
        self.observer, self.places, self.traced = observer, places, traced
        self.trace: RequestTrace = observer.start(protocol)
        self.exported = observer.export(self.trace, traceparent)
        """The request's OpenTelemetry root span (``None``: no export), ended with the trace on close."""
        self.call: Any = None
        """The request's :class:`services.ingress.call_stream.Call` once its chain is issued (its stream is cancelled on
        close)."""
        self.outcome: Outcome | None = None
        self.error: PrismError | None = None
        self._admitted = False
        self._detached = False
        self._held: list[Callable[[], None]] = []

    def hold(self, release: Callable[[], None]) -> None:
        """Something the request took (its tenant's quota place, body bytes …): ``release`` runs when it closes,
        however it closes (once)."""
        self._held.append(release)

    async def __aenter__(self) -> RequestLifecycle:
        try:
            self.places.acquire()
        except PrismError as exc:
            self.close(exc)
            raise
        self._admitted = True
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None or not self._detached:
            self.close(exc)
        return False

    def detach(self) -> RequestLifecycle:
        """Leave the lifecycle open when the ``async with`` block ends: a response body closes it later."""
        self._detached = True
        return self

    def abandon(self) -> None:
        """Close as CANCELLED (no-op once closed)."""
        self.close(asyncio.CancelledError())

    def close(self, exc: BaseException | None = None) -> PrismError | None:
        """Close with the outcome ``exc`` means (``None``: OK); returns the typed error the client gets, if any."""
        if self.outcome is not None:
            return self.error
        kv_blocks = getattr(self.call, "kv_blocks", 0)
        if exc is None:
            self.outcome, status, code = Outcome.OK, 200, "ok"
        elif isinstance(exc, CANCELLED):
            self.outcome, status, code = Outcome.CANCELLED, CANCELLED_STATUS, "cancelled"
        else:
            self.error = typed_error(exc, self.places.retry_after_s)
            status, code = self.error.http_status, self.error.code
            self.outcome = Outcome.FAILED if status >= 500 else Outcome.REFUSED
            if status >= 500:
                log_failure(self.trace.request_id, status, code, exc)
        try:
            if self.call is not None:
                self.call.close()  # cancels what of its chain still runs (frees KV at once)
            self.observer.finish(self.trace, status, code, kv_blocks, self.exported)
        finally:  # what the request holds goes back whatever the above did
            self._release_held()
        return self.error

    def _release_held(self) -> None:
        held, self._held = self._held, []
        try:
            for release in reversed(held):
                release()
        finally:
            if self._admitted:
                self._admitted = False
                self.places.release()

    def response_headers(self) -> dict[str, str]:
        """Headers every response of the request carries: ``traceresponse`` when its spans are exported."""
        return {} if self.exported is None else {"traceresponse": self.exported.traceresponse}

    def summary(self) -> dict[str, Any] | None:
        """The trace summary when the client asked for it — without cache outcomes unless
        ``observability.trace_cache_hits`` (a hit tells one caller what another sent within its cache scope)."""
        if not self.traced:
            return None
        return self.trace.summary(cache_outcomes=self.observer.cfg.trace_cache_hits)
