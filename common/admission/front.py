"""Per-tenant shares of the front door's in-flight places: the first place where tenants' requests wait together.

The proxy guard (``services/platform/proxy_http.py``) knows a request's tenant from its API key before it reads one
byte of the body, and holds each request's *place* from then until its response ends. Lifecycle of one place:

``await door.enter(tenant)`` — granted at once while the door holds fewer than ``places`` requests, or while the
tenant holds less than its fair share of them; otherwise the request waits in its tenant's FIFO queue, its body
unread (or, with ``max_waiting`` of that tenant's requests already queued, is refused 429
``tenant_share_exceeded`` with a Retry-After) → the request reads its body and runs → ``door.leave(tenant)`` when it
ends, however it ends, gives the place back and lets in the waiter whose tenant holds the fewest places for its
weight (while that tenant is within its share, or a place is free).

The shares: ``places`` split max-min fairly by weight between the tenants that hold or want places (their demand:
in flight + queued) — a tenant that wants less than an equal part leaves the rest to the others, so the door is
work-conserving: a tenant alone may use every place, a second one that arrives gets its share at once. A tenant below
its share enters even while every place is held (the door then holds more than ``places`` until the tenants past
their shares have let enough requests end — never more than ``2 × places``, a hard ceiling): a newcomer never waits
for a flooder's request to end, and the flooder's next requests wait until it is back within its share. A request
waiting here whose client went away is found out when it gets its place (the application then sees the disconnect).

A tenant is any hashable name (the guard's: ``(application, tenant)``). Pure asyncio, one event loop (the
proxy's); no Ray.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Mapping

from common.errors import Overloaded


class TenantShareExceeded(Overloaded):
    """A tenant's requests already fill its share of the front door's places and its queue there."""

    default_code = "tenant_share_exceeded"


def water_fill(
    capacity: float, demand: Mapping[Hashable, float], weight: Mapping[Hashable, float]
) -> dict[Hashable, float]:
    """Max-min fair split of ``capacity`` by weight: a tenant wanting less than its weighted part gets what it wants,
    and what it leaves is split again between the others."""
    share: dict[Hashable, float] = {}
    left, open_ = float(capacity), {t: d for t, d in demand.items() if d > 0}
    while open_:
        unit = left / sum(weight[t] for t in open_)
        content = {t: d for t, d in open_.items() if d <= unit * weight[t]}
        if not content:
            share.update({t: unit * weight[t] for t in open_})
            break
        for t, d in content.items():
            share[t] = d
            left -= d
            del open_[t]
    return share


class FrontDoor:
    def __init__(
        self,
        places: int,
        max_waiting: int,
        retry_after_s: float,
        weight: Callable[[Hashable], float] = lambda tenant: 1.0,
    ) -> None:
        if places < 1 or max_waiting < 0:
            raise ValueError("places ≥ 1 and max_waiting ≥ 0")
        self.places, self.max_waiting, self.retry_after_s, self.weight = places, max_waiting, retry_after_s, weight
        self.in_flight: dict[Hashable, int] = {}
        self.queues: dict[Hashable, deque[asyncio.Future[None]]] = {}
        self.total = 0
        self.waited: dict[Hashable, int] = {}
        """Requests of each tenant that had to queue (for metrics and tests)."""
        self.refused: dict[Hashable, int] = {}
        """Requests of each tenant refused for a full queue."""

    # ---- shares -------------------------------------------------------------------------------------------------
    def shares(self, arriving: Hashable | None = None) -> dict[Hashable, float]:
        """Each active tenant's share of the places (``arriving`` counted as wanting one more)."""
        demand = {t: float(n) for t, n in self.in_flight.items()}
        for t, queue in self.queues.items():
            demand[t] = demand.get(t, 0.0) + len(queue)
        if arriving is not None:
            demand[arriving] = demand.get(arriving, 0.0) + 1
        return water_fill(self.places, demand, {t: self.weight(t) for t in demand})

    def _may_enter(self, tenant: Hashable, shares: Mapping[Hashable, float]) -> bool:
        if self.total < self.places:
            return True
        return self.total < 2 * self.places and self.in_flight.get(tenant, 0) < shares.get(tenant, 0.0)

    # ---- places -------------------------------------------------------------------------------------------------
    async def enter(self, tenant: Hashable) -> None:
        """Take a place for one request of ``tenant`` (waiting for it if need be); raise
        :class:`TenantShareExceeded` if the tenant's queue is full. Pair with :meth:`leave` once it returned."""
        if not self.queues.get(tenant) and self._may_enter(tenant, self.shares(tenant)):
            self._take(tenant)
            return
        queue = self.queues.setdefault(tenant, deque())
        if len(queue) >= self.max_waiting:
            if not queue:
                del self.queues[tenant]
            self.refused[tenant] = self.refused.get(tenant, 0) + 1
            raise TenantShareExceeded(
                f"this API key's tenant already has {self.in_flight.get(tenant, 0)} requests in flight and "
                f"{len(queue)} waiting at the front door, its share while other tenants' requests are served; "
                "retry later",
                retry_after_s=self.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self.waited[tenant] = self.waited.get(tenant, 0) + 1
        try:
            await waiter
        except BaseException:  # the caller's task was cancelled while it waited, or as it got in
            if waiter.done() and not waiter.cancelled():
                self.leave(tenant)  # it had the place: give it back
            else:
                self._forget(tenant, waiter)
            raise

    def leave(self, tenant: Hashable) -> None:
        """Give back a place :meth:`enter` granted; the waiters that may now enter get theirs."""
        self.total -= 1
        left = self.in_flight[tenant] - 1
        if left:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]
        self._admit_waiting()

    def _take(self, tenant: Hashable) -> None:
        self.total += 1
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1

    def _forget(self, tenant: Hashable, waiter: asyncio.Future[None]) -> None:
        queue = self.queues.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self.queues[tenant]
        self._admit_waiting()  # (its demand no longer counts: another tenant's share may have grown)

    def _admit_waiting(self) -> None:
        while True:
            shares = self.shares()
            ready = [t for t in self.queues if self._may_enter(t, shares)]
            if not ready:
                return
            tenant = min(ready, key=lambda t: self.in_flight.get(t, 0) / self.weight(t))
            queue = self.queues[tenant]
            waiter = queue.popleft()
            if not queue:
                del self.queues[tenant]
            if waiter.done():  # (cancelled: its task is on its way out)
                continue
            waiter.set_result(None)
            self._take(tenant)
