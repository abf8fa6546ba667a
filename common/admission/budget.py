"""A stage replica's in-flight budget: admit work by its size, queue the rest fairly between tenants (in rank order
within each), refuse what cannot wait.

Each stage replica holds one :class:`BudgetGate` over the unit its cost grows with (pixels being decoded in media,
patches queued or encoding in encode, prompt tokens queued or computing in prefill). Lifecycle of one request:

``acquire(amount, deadline, rank, tenant, weight)`` (:mod:`common.admission.protocol`) → admitted at once if nobody
waits and the amount fits → otherwise it **waits** in its tenant's queue, in rank order (lowest first; :func:`rank` =
arrival + size/aging + class delay), the tenants served fairly by their weights
(:class:`common.fair.FairQueue`: the tenant with the least service in this budget's unit goes next, within
the class that goes first) → granted when it is the head of that order and its amount fits → ``release(grant)`` when
its work is done, whatever the outcome. Every grant, waited for or not, is charged to its tenant's share.

Refused instead of waiting, with a typed error that names the budget:

* the wait queue is full (``max_waiting``) and its tenant already has its weighted share of the places in it → 429
  ``server_overloaded`` with Retry-After (a tenant with less still waits: a flooder that filled the queue does not
  lock the others out — so the queue can hold up to about twice ``max_waiting``, the flooder's places and the
  others' shares);
* the wait it can expect (what is in flight and what the fair order grants ahead of it ÷ the budget's measured drain
  rate) ends past its deadline → 429 at once rather than a 504 later (a deadline already passed is a 504);
* its deadline passes while it waits → 504 ``deadline_exceeded``; a waiter whose caller went away (cancelled) leaves
  the queue, and if it was granted in that instant its amount is given straight back.

Retry-After is the time the budget needs to drain what is queued ahead plus this request, from the units released
over the last ``DRAIN_WINDOW_S`` seconds (the configured value until anything was released). A large item at the
head of the order holds smaller ones behind it until it fits: ranks age and tags rise, so nothing starves. An amount
larger than the whole budget is clamped to it: it runs alone once the stage is empty; an amount of 0 never waits.

Single event loop only (a Serve replica's): no locks, grants happen in :meth:`release` and :meth:`acquire`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

from common.admission.protocol import Grant
from common.errors import DeadlineExceeded, Overloaded
from common.fair import FairQueue, Waiter

DRAIN_WINDOW_S = 30.0
MAX_RETRY_AFTER_S = 60.0


def rank(arrival: float, size: int, aging_per_s: float, batch: bool, batch_delay_s: float) -> float:
    """Virtual arrival time: shortest first, with aging (a request of ``size`` units ranks as if it arrived
    ``size / aging_per_s`` seconds later) and batch traffic behind interactive (``batch_delay_s`` later)."""
    return arrival + size / aging_per_s + (batch_delay_s if batch else 0.0)


def drain_wait_s(excess: float, rate: float | None, default_s: float) -> float:
    """Seconds to drain ``excess`` units at ``rate`` units per second (``default_s`` while there is no rate yet);
    0 when nothing is in excess."""
    if excess <= 0:
        return 0.0
    return default_s if rate is None else excess / rate


def retry_after(expected_s: float) -> float:
    """A Retry-After from an expected wait: whole seconds, at least 1, at most ``MAX_RETRY_AFTER_S``."""
    return min(MAX_RETRY_AFTER_S, max(1.0, math.ceil(expected_s)))


class BudgetGate:
    """A :class:`common.admission.protocol.Gate` over one budget of a stage replica (see the module docstring)."""

    def __init__(
        self,
        stage: str,
        unit: str,
        capacity: int,
        max_waiting: int,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be ≥ 1")
        self.stage, self.unit, self.capacity = stage, unit, capacity
        self.max_waiting, self.default_retry_after = max_waiting, retry_after_s
        self.clock = clock
        self.used = 0
        self.fair = FairQueue()
        self._seq = itertools.count()
        self._released: deque[tuple[float, int]] = deque()

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(1 for _ in self.fair.live())

    @property
    def waiting_amount(self) -> int:
        return sum(w.amount for w in self.fair.live())

    def drain_rate(self) -> float | None:
        """Units released per second over the recent window (``None`` before anything was released)."""
        now = self.clock()
        while self._released and self._released[0][0] < now - DRAIN_WINDOW_S:
            self._released.popleft()
        if not self._released:
            return None
        span = max(now - self._released[0][0], 1.0)
        return sum(a for _, a in self._released) / span

    def expected_wait_s(self, amount: int, rank_: float | None = None, tenant: str = "", weight: float = 1.0) -> float:
        """Seconds until ``amount`` more of ``tenant`` would fit behind what is in flight and what the fair order
        grants ahead of it (:meth:`FairQueue.ahead_of`; ``rank_`` ``None``: behind all of its tenant's waiters); 0 if
        it fits now."""
        ahead = self.fair.ahead_of(tenant, weight, amount, rank_)
        excess = self.used + ahead + amount - self.capacity
        return drain_wait_s(excess, self.drain_rate(), self.default_retry_after)

    def retry_after_s(self, amount: int, tenant: str = "", weight: float = 1.0) -> float:
        return retry_after(self.expected_wait_s(amount, None, tenant, weight))

    # ---- admit / release ------------------------------------------------------------------------------------
    async def acquire(
        self,
        amount: int,
        deadline: float,
        rank: float,
        tenant: str = "",
        weight: float = 1.0,
        *,
        key: str = "",
        refuse: bool = True,
        batch: bool = False,
    ) -> Grant:
        """Admit ``amount`` (clamped to the budget) before ``deadline`` (this gate's clock), or raise; ``refuse=False``
        waits whatever the queue (no 429); ``batch``: the request's class (interactive goes first)."""
        amount = max(0, min(int(amount), self.capacity))
        start = self.clock()
        if amount == 0 or (not self.waiting and self.used + amount <= self.capacity):
            self.used += amount  # (nothing to wait for: e.g. every item an encoder-cache hit)
            if amount:  # (a request that costs nothing is no service: it must not move the fair order's clock)
                self.fair.served(tenant, amount, weight)
            return Grant(amount, 0.0, key)
        left = deadline - start
        if left <= 0:
            raise DeadlineExceeded(f"deadline exceeded before the {self.stage} stage could admit the request")
        if refuse:
            self._check_room(amount, left, rank, tenant, weight)
        future = asyncio.get_running_loop().create_future()
        waiter = Waiter(rank, next(self._seq), amount, tenant, weight, batch, future)
        self.fair.push(waiter)
        self._grant()  # it may rank first and fit at once
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=left)
        except BaseException as exc:  # deadline, or the caller went away
            if waiter.future.done() and not waiter.future.cancelled():
                self.fair.refund(tenant, amount, weight)  # granted in the same instant it gave up: not served
                self._give_back(amount)
            else:
                waiter.future.cancel()  # leaves the queue (skipped by _grant)
                self._grant()  # it may have been holding smaller requests behind it
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(f"deadline exceeded waiting for room in the {self.stage} stage") from None
            raise
        return Grant(amount, self.clock() - start, key)

    def _check_room(self, amount: int, left: float, rank: float, tenant: str, weight: float) -> None:
        """Refuse (429) a request that must not wait: the queue is full and its tenant holds its share of the places
        in it already, or its expected wait outlasts its deadline."""
        if self.waiting >= self.max_waiting and self.fair.waiting_of(tenant) >= self.fair.place_share(
            tenant, weight, self.max_waiting
        ):
            raise Overloaded(
                f"the {self.stage} stage is at capacity ({self.capacity} {self.unit} in flight, {self.waiting} "
                "waiting); retry later",
                retry_after_s=self.retry_after_s(amount, tenant, weight),
            )
        expected = self.expected_wait_s(amount, rank, tenant, weight)
        if expected >= left:
            raise Overloaded(
                f"the {self.stage} stage would take about {expected:.1f}s to make room for this request "
                f"({amount} {self.unit}); its deadline is in {max(left, 0):.1f}s",
                retry_after_s=self.retry_after_s(amount, tenant, weight),
            )

    def release(self, grant: Grant) -> None:
        self._give_back(grant.amount)

    def _give_back(self, amount: int) -> None:
        if amount <= 0:
            return
        self.used -= amount
        if self.used < 0:
            raise RuntimeError(f"the {self.stage} budget released more {self.unit} than it admitted")
        self._released.append((self.clock(), amount))
        self._grant()

    def _grant(self) -> None:
        while (head := self.fair.head()) is not None:  # (waiters that gave up are skipped)
            if self.used + head.amount > self.capacity:
                return
            self.fair.pop(head)
            self.used += head.amount
            head.future.set_result(None)
