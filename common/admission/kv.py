"""The decode stage's gate: a request's KV blocks reserved in a decode replica's pool before prefill computes them.

The decode stage's budget is its KV pool: a request reserves its blocks (prompt + ``max_tokens``) before prefill
computes, through :class:`KVGate` — the same :class:`common.admission.protocol.Gate` as every other stage budget — into
the engine's reservations (:meth:`common.engine.decode.DecodeEngine.reserve`). A reservation that fits is granted at
once; one that does not waits in the pool's lease queue — unless :meth:`KVAdmission.check` refuses it first with 429
``server_overloaded``:

* the queue already holds ``max_waiting`` leases (reservations, prefilled sequences waiting for their lease) and its
  tenant already holds its weighted share of those places (so a flooder that filled the queue cannot lock the others
  out);
* the wait it can expect — the blocks the pool's fair order grants ahead of it (its own tenant's leases ranked before
  it, and about as much from each other tenant as the order serves them meanwhile) plus its own, beyond what is
  available now, at the
  rate capacity has come back over the last ``DRAIN_WINDOW_S`` seconds — ends past its deadline (a 429 now rather
  than a 504 later).

Retry-After is that expected wait, rounded up, between 1 and ``MAX_RETRY_AFTER_S`` (the configured value while no
block has been freed yet to measure a rate from). The rate is sampled from the pool's ``freed_total`` counter each
time :meth:`KVAdmission.sample` is called (the decode stage does after every step and every decision), so it needs
no hook in the pool. The rules and constants of the other stages' budgets (:mod:`common.admission.budget`), except
that a full queue refuses only a reservation that would have to wait.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from common.admission.budget import DRAIN_WINDOW_S, drain_wait_s, retry_after
from common.admission.protocol import Grant
from common.errors import DeadlineExceeded, Overloaded
from common.kv.pool import KVPool


class KVAdmission:
    def __init__(
        self, pool: KVPool, max_waiting: int, retry_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool, self.max_waiting, self.default_retry_after = pool, max_waiting, retry_after_s
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self) -> None:
        """Record the pool's freed-blocks counter now; samples older than the window are forgotten (an idle replica
        takes none, so the first one after a pause starts the window afresh rather than averaging over the pause)."""
        now = self.clock()
        self._samples.append((now, self.pool.freed_total))
        while self._samples[0][0] < now - DRAIN_WINDOW_S:
            self._samples.popleft()

    def drain_rate(self) -> float | None:
        """Blocks freed per second over the recent window (``None`` when none was freed in it)."""
        self.sample()
        (t0, f0), (t1, f1) = self._samples[0], self._samples[-1]
        if f1 <= f0:
            return None
        return (f1 - f0) / max(t1 - t0, 1.0)

    def expected_wait_s(
        self, blocks: int, rank: float | None = None, tenant: str | None = None, weight: float = 1.0
    ) -> float:
        """Seconds until ``blocks`` more would be granted behind what is queued ahead of ``rank`` (all of the queue
        when ``None``) — for a ``tenant``'s reservation, what the fair order grants ahead of it; 0 if they fit now."""
        ahead = self.pool.blocks_ahead(math.inf if rank is None else rank, tenant, weight, blocks)
        return drain_wait_s(ahead + blocks - self.pool.available_blocks, self.drain_rate(), self.default_retry_after)

    def retry_after_s(self, blocks: int) -> float:
        return retry_after(self.expected_wait_s(blocks))

    def check(
        self, blocks: int, left_s: float, rank: float | None = None, tenant: str | None = None, weight: float = 1.0
    ) -> None:
        """Raise :class:`Overloaded` if a reservation of ``blocks`` ranked ``rank`` (of ``tenant``) must not wait
        (see the module docstring)."""
        pool = self.pool
        expected = self.expected_wait_s(blocks, rank, tenant, weight)
        if (
            pool.num_waiting >= self.max_waiting
            and expected > 0
            and pool.holds_wait_share(tenant, weight, self.max_waiting)
        ):
            raise Overloaded(
                f"the decode stage's KV pool is full ({pool.used_blocks} of {pool.num_blocks} blocks in use, "
                f"{pool.num_waiting} requests waiting for KV); retry later",
                retry_after_s=retry_after(expected),
            )
        if expected >= left_s:
            ahead = pool.blocks_ahead(math.inf if rank is None else rank, tenant, weight, blocks)
            raise Overloaded(
                f"the decode stage would take about {expected:.1f}s to free {blocks} KV blocks for this request "
                f"({pool.available_blocks} of {pool.num_blocks} available, {ahead} queued ahead); its "
                f"deadline is in {max(left_s, 0):.1f}s",
                retry_after_s=retry_after(expected),
            )


class LeaseBook(Protocol):
    """The reservations a :class:`KVGate` admits into (:class:`common.engine.decode.DecodeEngine` keeps them: a
    reservation is a lease in its pool, filed under the attempt's key, claimed later by that attempt's sequence)."""

    def reserve(
        self,
        request_id: str,
        blocks: int,
        deadline: float | None = None,
        rank: float | None = None,
        tenant: str = "",
        weight: float = 1.0,
        batch: bool = False,
    ) -> bool:
        """Lease (or queue as ``tenant``'s, by ``rank``) ``blocks`` under ``request_id``; True if granted now."""
        ...

    def reservation_granted(self, request_id: str) -> bool: ...

    def is_reserved(self, request_id: str) -> bool: ...

    def hold(self, request_id: str, until: float) -> None:
        """Let an unclaimed reservation lapse at ``until`` at the latest."""
        ...

    def unreserve(self, request_id: str) -> bool:
        """Drop an unclaimed reservation; False if there is none."""
        ...

    def expire_leases(self) -> None:
        """Drop unclaimed reservations past their deadline, time out sequences that waited for a lease past theirs."""
        ...

    @property
    def leases_pending(self) -> bool:
        """Whether any reservation or lease-waiting sequence is left for :meth:`expire_leases` to watch."""
        ...


class KVGate:
    """The decode stage's :class:`common.admission.protocol.Gate`: a grant is a KV reservation of ``amount`` blocks in
    the replica's pool, filed under the caller's ``key``.

    ``acquire`` — under the engine's lock (steps run under it in a worker thread) — runs ``precheck`` (the stage's own
    refusals: request slots), then, unless ``refuse`` is off, :meth:`KVAdmission.check` (429 when the wait would
    outlast the deadline or the queue is full), then leases: granted at once, or the caller waits for the pool to grant
    it (504 at its deadline; a caller that goes away gives it back). The pool grants leases as blocks free; the stage
    calls :meth:`wake` whenever leases changed, which resolves the waiters. A reservation nobody claims goes back with
    :meth:`release` / :meth:`drop` (the ingress: its chain failed), ``hold_s`` after it was granted, or at its
    deadline, whichever comes first: a sweep runs every ``sweep_s``
    while the book has anything pending (it also times out sequences waiting for their lease when nothing steps).
    ``on_change`` is the stage's hook for "leases changed" (wake, refresh its gauges, poke its driver).
    """

    stage = "decode"
    unit = "KV blocks"

    def __init__(
        self,
        book: LeaseBook,
        admission: KVAdmission,
        lock: asyncio.Lock,
        on_change: Callable[[], None],
        precheck: Callable[[], None] | None = None,
        sweep_s: float = 1.0,
        hold_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``hold_s``: how long a granted reservation waits for its sequence to claim it before it lapses (whatever
        the request's deadline)."""
        self.book, self.admission, self.lock, self.on_change = book, admission, lock, on_change
        self.precheck, self.sweep_s, self.hold_s, self.clock = precheck, sweep_s, hold_s, clock
        self._waiters: dict[str, asyncio.Future[bool]] = {}  # reservations waiting for their blocks
        self._sweeper: asyncio.Task | None = None

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
        start = self.clock()
        left = deadline - start
        async with self.lock:
            if self.precheck is not None:
                self.precheck()
            if refuse:
                self.admission.check(amount, left, rank, tenant, weight)
            granted = self.book.reserve(key, amount, deadline, rank, tenant, weight, batch)
            waiter = None if granted else asyncio.get_running_loop().create_future()
            if waiter is not None:
                self._waiters[key] = waiter
            else:
                self.book.hold(key, self.clock() + self.hold_s)
        self.keep_sweeping()
        self.on_change()
        if waiter is None:
            return Grant(amount, 0.0, key)
        await self._wait(key, waiter, left)
        async with self.lock:
            self.book.hold(key, self.clock() + self.hold_s)
        return Grant(amount, self.clock() - start, key)

    async def _wait(self, key: str, waiter: asyncio.Future[bool], left: float) -> None:
        try:
            kept = await asyncio.wait_for(asyncio.shield(waiter), timeout=left)
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # granted in the instant the caller went away
                raise asyncio.CancelledError
        except BaseException as exc:  # deadline, or the caller went away: give the place (or the grant) back
            self._waiters.pop(key, None)
            asyncio.get_running_loop().create_task(self.drop(key))
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("deadline exceeded waiting for KV blocks in the decode stage") from None
            raise
        if not kept:  # dropped by the sweep at its deadline (or by the ingress, which no longer waits for it)
            raise DeadlineExceeded("deadline exceeded waiting for KV blocks in the decode stage")

    def release(self, grant: Grant) -> None:
        """Give back an unclaimed reservation (one its sequence claimed is the sequence's to free)."""
        asyncio.get_running_loop().create_task(self.drop(grant.key))

    async def drop(self, key: str) -> bool:
        """Drop ``key``'s reservation if no sequence claimed it; True if there was one."""
        async with self.lock:
            dropped = self.book.unreserve(key)
        self.on_change()
        return dropped

    @property
    def waiting(self) -> int:
        """Reservations waiting for their blocks."""
        return len(self._waiters)

    def wake(self) -> None:
        """Resolve the waiting reservations that the pool granted (True) or that were dropped meanwhile (False)."""
        self.admission.sample()
        for key, waiter in list(self._waiters.items()):
            granted = self.book.reservation_granted(key)
            if granted or not self.book.is_reserved(key):
                del self._waiters[key]
                if not waiter.done():
                    waiter.set_result(granted)

    def keep_sweeping(self) -> None:
        """Make sure a sweep runs while anything is pending (see the class docstring)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while self.book.leases_pending:
            await asyncio.sleep(self.sweep_s)
            async with self.lock:
                self.book.expire_leases()
            self.on_change()
