"""Fair sharing of one resource between tenants: the wait queue of a gate, served by start-time fair queueing.

A gate over a stage's capacity (media pixels, encode patches, prefill tokens) keeps its waiters here instead of in
one rank-ordered heap. Each tenant has its own queue, ordered by the request's rank (arrival + size ÷ aging + the
class delay: :func:`common.admission.budget.rank`), and a *tag*: the service it has had so far, in the resource's own
unit divided by its weight. Lifecycle of one waiter:

``push(waiter)`` → it waits in its tenant's queue → :meth:`FairQueue.head` names the waiter that goes next — the
head of the tenant with the least service (lowest start tag), within the class that goes first — and the gate grants
it when its amount fits → :meth:`FairQueue.pop` takes it out and charges its tenant (:meth:`FairQueue.served`; a
request granted at once, without waiting, is charged the same way) → a waiter that gave up (its future done) is
skipped and dropped.

Start-time fair queueing (Goyal et al., 1996): a tenant's start tag is ``max(virtual time, its finish tag)``, its
finish tag grows by ``amount / weight`` each time it is served, and the virtual time is the start tag of the last
request served. So under saturation each tenant's service converges to its weight's share; a tenant that was idle
starts level with the others (no credit banked while away, no debt kept from before); a lone tenant is served as
fast as the capacity allows (the queue is work-conserving: it orders, it never holds capacity back). No tenant
starves: every grant raises the served tenant's tag, so a waiting tenant's becomes the lowest after finitely many
grants, and within a tenant ranks age.

Classes: interactive before batch, as the ranks alone order them — a batch head competes as interactive once its
rank is no later than the earliest interactive head's (its class delay has run out), and otherwise waits until no
interactive head is left.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class Waiter:
    rank: float
    seq: int
    amount: int = field(compare=False)
    tenant: str = field(compare=False, default="")
    weight: float = field(compare=False, default=1.0)
    batch: bool = field(compare=False, default=False)
    future: Any = field(compare=False, default=None)
    """Its grant: an ``asyncio.Future`` (done: granted, or given up — skipped either way)."""
    key: str = field(compare=False, default="")
    """Its owner's name for it (the KV pool's: the request id)."""
    gone: bool = field(compare=False, default=False)
    """Taken out by its owner without a future (the KV pool's queue: a lease released while it waited)."""

    @property
    def live(self) -> bool:
        return not self.gone and (self.future is None or not self.future.done())


class FairQueue:
    def __init__(self) -> None:
        self._queues: dict[str, list[Waiter]] = {}
        self._finish: dict[str, float] = {}
        self.vtime = 0.0
        self.service: dict[str, float] = {}
        """Units each tenant was granted (for metrics and tests)."""

    # ---- tags -------------------------------------------------------------------------------------------------
    def start_tag(self, tenant: str) -> float:
        return max(self.vtime, self._finish.get(tenant, 0.0))

    def served(self, tenant: str, amount: int, weight: float = 1.0) -> None:
        """Charge ``tenant`` for ``amount`` units granted (waiting or not)."""
        start = self.start_tag(tenant)
        self._finish[tenant] = start + amount / max(weight, 1e-9)
        self.vtime = start
        self.service[tenant] = self.service.get(tenant, 0.0) + amount
        # tenants level with the virtual time and nothing queued carry no information: forget them
        for name in [t for t, f in self._finish.items() if f <= self.vtime and not self._queues.get(t)]:
            del self._finish[name]

    def refund(self, tenant: str, amount: int, weight: float = 1.0) -> None:
        """Undo a charge of :meth:`served` (a grant its caller gave up in the same instant it came)."""
        if tenant in self._finish:
            self._finish[tenant] -= amount / max(weight, 1e-9)
        self.service[tenant] = self.service.get(tenant, 0.0) - amount

    # ---- queue ------------------------------------------------------------------------------------------------
    def push(self, waiter: Waiter) -> None:
        heapq.heappush(self._queues.setdefault(waiter.tenant, []), waiter)

    def _head_of(self, tenant: str) -> Waiter | None:
        queue = self._queues.get(tenant)
        while queue and not queue[0].live:
            heapq.heappop(queue)
        if not queue:
            self._queues.pop(tenant, None)
            return None
        return queue[0]

    def head(self) -> Waiter | None:
        """The waiter to grant next (``None`` when nobody waits)."""
        heads = [h for h in (self._head_of(t) for t in list(self._queues)) if h is not None]
        if not heads:
            return None
        interactive = [h.rank for h in heads if not h.batch]
        if interactive:
            first = min(interactive)
            heads = [h for h in heads if not h.batch or h.rank <= first]
        return min(heads, key=lambda h: (self.start_tag(h.tenant), h.rank, h.seq))

    def pop(self, waiter: Waiter) -> None:
        """Take ``waiter`` (the current :meth:`head`) out and charge its tenant."""
        queue = self._queues[waiter.tenant]
        if queue[0] is not waiter:
            raise ValueError("only the head of a tenant's queue is popped")
        heapq.heappop(queue)
        if not queue:
            del self._queues[waiter.tenant]
        self.served(waiter.tenant, waiter.amount, waiter.weight)

    def live(self) -> Iterator[Waiter]:
        for queue in self._queues.values():
            yield from (w for w in queue if w.live)

    def waiting_of(self, tenant: str) -> int:
        """Live waiters of ``tenant``."""
        return sum(1 for w in self._queues.get(tenant, ()) if w.live)

    def place_share(self, tenant: str, weight: float, places: int) -> float:
        """``tenant``'s share of ``places`` wait places: its weight's part of the weights of the tenants waiting (it
        included)."""
        weights = {w.tenant: w.weight for w in self.live()} | {tenant: weight}
        return places * weight / sum(weights.values())

    def ahead_of(self, tenant: str, weight: float, amount: int, rank: float | None) -> int:
        """Units likely granted before a request of ``tenant`` (``amount``, ranked ``rank``; ``None``: behind all of
        its tenant's waiters) would be: its own tenant's waiters ranked before it, and from each other tenant about
        as much as the fair order serves them meanwhile (the same virtual service, scaled by the weights, from where
        their tags stand), never more than they have waiting."""
        waiting: dict[str, int] = {}
        own = 0
        for w in self.live():
            if w.tenant == tenant:
                own += w.amount if rank is None or w.rank <= rank else 0
            else:
                waiting[w.tenant] = waiting.get(w.tenant, 0) + w.amount
        mine = self.start_tag(tenant) + own / max(weight, 1e-9)  # its start tag: what others get before it is served
        others = 0
        for name, units in waiting.items():
            w = next(x.weight for x in self._queues.get(name, []) if x.live)
            others += min(units, max(0.0, (mine - self.start_tag(name)) * w))
        return own + int(others)
