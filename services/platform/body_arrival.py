r"""How a request body must arrive through the proxy guard (:mod:`services.platform.proxy_http`): its structural width
counted as it passes (:class:`Structure`, step 5 of the guard), and its pace (:class:`Arrival`, step 6) — a body that
keeps the server waiting past its allowance raises :class:`TooSlow`, which the guard answers 408 (:func:`too_slow`).

Lifecycle: the guard makes one :class:`Arrival` and at most one :class:`Structure` per request, reads every body
piece through :meth:`Arrival.receive` (its own reads and the application's), and :meth:`Arrival.close`\ s it when the
request is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.errors import InvalidRequestError, RequestTimeout
from common.protocol.body import STRUCTURAL
from services.platform.guard_settings import GuardSettings
from services.platform.request_headers import Message, Receive


class TooSlow(Exception):
    pass


class Structure:
    """A body's structural characters (``{ [ , :``), counted chunk by chunk as it passes (base64 holds none)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def add(self, chunk: bytes) -> None:
        for char in STRUCTURAL:
            self.count += chunk.count(char)
        if self.count > self.limit:
            raise InvalidRequestError(
                f"request JSON has more than {self.limit} structural characters ({{ [ , :), the limit",
                code="json_too_wide",
            )


class Arrival:
    """How long a body may keep the server waiting: ``grace_s``, plus ``1 / min_rate`` per byte received — counted
    only while someone waits on the client for more."""

    def __init__(self, grace_s: float, min_rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.min_rate, self.clock = grace_s, min_rate, clock
        self.waited, self.received = 0.0, 0
        self.ended = False
        """Whether the body has ended (its last piece came, or the client left)."""
        self.pending: asyncio.Future[Message] | None = None
        """The server's ``receive`` under way, shared by whoever waits for the next piece. Serve's direct ingress
        reads through a task of its own that it cancels when the application returns — a cancel that
        ``asyncio.wait_for`` swallows when the piece has just come (Python 3.11), so that task may still be reading
        when the guard drains: both then get the same piece, counted once, and none is lost (a lost last piece would
        leave a drain waiting for an end that already came)."""

    def allowance(self) -> float:
        return self.grace_s + self.received / self.min_rate - self.waited

    async def receive(self, receive: Receive) -> Message:
        left = self.allowance()
        if left <= 0:
            raise TooSlow
        start = self.clock()
        if self.pending is None:
            self.pending = asyncio.ensure_future(receive())
        piece = self.pending
        try:
            message = await asyncio.wait_for(asyncio.shield(piece), timeout=left)
        except TimeoutError:
            raise TooSlow from None
        finally:
            self.waited += self.clock() - start
        if self.pending is piece:  # the first to take it: counted, and the next call reads the next piece
            self.pending = None
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
            self.ended = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    def close(self) -> None:
        """Cancel a ``receive`` no one will take (the request is over)."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None


def too_slow(settings: GuardSettings) -> RequestTimeout:
    return RequestTimeout(
        f"the request body arrived slower than {settings.body_min_bytes_per_s} bytes/s after "
        f"{settings.body_grace_s:g} s; it was dropped"
    )
