"""Whether a KV reservation may wait for room in a decode replica's pool, and the Retry-After when it may not.

The decode stage's budget is its KV pool: a request reserves its blocks (prompt + ``max_tokens``) before prefill
computes (:meth:`common.engine.decode.DecodeEngine.reserve`). A reservation that fits is granted at once; one that
does not waits in the pool's lease queue — unless :meth:`KVAdmission.check` refuses it first with 429
``server_overloaded``:

* the queue already holds ``max_waiting`` leases (reservations, prefilled sequences waiting for their lease);
* the wait it can expect — the blocks queued ahead of its rank plus its own, beyond what is available now, at the
  rate capacity has come back over the last ``DRAIN_WINDOW_S`` seconds — ends past its deadline (a 429 now rather
  than a 504 later).

Retry-After is that expected wait, rounded up, between 1 and ``MAX_RETRY_AFTER_S`` (the configured value while no
block has been freed yet to measure a rate from). The rate is sampled from the pool's ``freed_total`` counter each
time :meth:`KVAdmission.sample` is called (the decode stage does after every step and every decision), so it needs
no hook in the pool. The rules and constants of the other stages' budgets (:mod:`common.admission.budget`), except
that a full queue refuses only a reservation that would have to wait.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from common.admission.budget import DRAIN_WINDOW_S, drain_wait_s, retry_after
from common.errors import Overloaded
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

    def expected_wait_s(self, blocks: int, rank: float | None = None) -> float:
        """Seconds until ``blocks`` more would be granted behind what is queued ahead of ``rank`` (all of the queue
        when ``None``); 0 if they fit now."""
        excess = self.pool.blocks_ahead(math.inf if rank is None else rank) + blocks - self.pool.available_blocks
        return drain_wait_s(excess, self.drain_rate(), self.default_retry_after)

    def retry_after_s(self, blocks: int) -> float:
        return retry_after(self.expected_wait_s(blocks))

    def check(self, blocks: int, left_s: float, rank: float | None = None) -> None:
        """Raise :class:`Overloaded` if a reservation of ``blocks`` ranked ``rank`` must not wait (see the module
        docstring)."""
        pool = self.pool
        expected = self.expected_wait_s(blocks, rank)
        if pool.num_waiting >= self.max_waiting and expected > 0:
            raise Overloaded(
                f"the decode stage's KV pool is full ({pool.used_blocks} of {pool.num_blocks} blocks in use, "
                f"{pool.num_waiting} requests waiting for KV); retry later",
                retry_after_s=retry_after(expected),
            )
        if expected >= left_s:
            ahead = pool.blocks_ahead(math.inf if rank is None else rank)
            raise Overloaded(
                f"the decode stage would take about {expected:.1f}s to free {blocks} KV blocks for this request "
                f"({pool.available_blocks} of {pool.num_blocks} available, {ahead} queued ahead); its "
                f"deadline is in {max(left_s, 0):.1f}s",
                retry_after_s=retry_after(expected),
            )
