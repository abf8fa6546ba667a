"""When work done for a request in a worker thread must stop: its deadline, or its caller going away.

A stage runs blocking work (a media download, a decode) in a thread, which asyncio cannot cancel. The stage hands
the thread a :class:`Stop`; the work calls :meth:`Stop.check` between units (a downloaded chunk, a decoded frame,
an item) and bounds its own timeouts by :meth:`Stop.left`. When the caller is cancelled, the stage sets the event
and the thread ends at its next check instead of running to its own limits for nobody.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from common.errors import DeadlineExceeded, PrismError


class Cancelled(PrismError):
    """The request's caller went away; the work stopped (nobody receives this status)."""

    http_status = 499
    default_code = "cancelled"


@dataclass(frozen=True)
class Stop:
    deadline: float | None = None
    """Monotonic seconds (this process's clock); ``None``: none."""
    event: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.event.set()

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check(self, what: str) -> None:
        if self.event.is_set():
            raise Cancelled(f"the request was cancelled during {what}")
        left = self.left()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"deadline exceeded during {what}")


NEVER = Stop()
"""No deadline and never cancelled (offline batch work, tests)."""
