"""The decode engine's queues: how a prefilled sequence gets its lease and its blocks, and how it leaves them.

A sequence is **queued** by :meth:`SequenceQueues.submit` with its KV at hand (copied into its blocks when its lease
is granted: **admitted**), or **landing** after :meth:`SequenceQueues.claim` gave it blocks before its KV arrived
(the transport moves the hand-off straight into them), run by :meth:`SequenceQueues.start`; either way it then
**begins** (the engine's ``_begin``: its first token, or its replay) and is **running**. :meth:`SequenceQueues.cancel`
drops it wherever it is; whatever frees blocks (a release, a smaller lease) admits the queued sequences the pool then
grants. A sequence's own blocks are allocated as one run when the pool has one (attention then reads its KV through
a view); choices after the first share the prompt's full blocks (:meth:`SequenceQueues._fork`).

A mixin of :class:`common.engine.decode.DecodeEngine` (after :class:`common.engine.reservations.Reservations`, whose
reservations :meth:`submit` and :meth:`claim` claim), which owns the state it reads: ``lm``, ``pool``,
``prefer_contiguous``, ``_pending`` (sequences waiting for a lease), ``_running`` / ``_live`` (running sequences, and
per request), ``_landing``, ``_reserved``, ``_events``, and ``_begin``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from common.engine.reservations import Reservations
from common.engine.sequence import RunningSequence, TokenEvent
from common.errors import HandoffError
from common.grammar.compiler import compiler_for
from common.kv.blocks import check_prefill, to_torch
from common.kv.pool import Lease
from common.model.loader import LoadedModel
from common.protocol.handoff import Prefilled, PrefillOutput
from common.protocol.sampling import SamplingParams


class SequenceQueues(Reservations):
    lm: LoadedModel
    prefer_contiguous: bool
    _pending: OrderedDict[str, tuple[PrefillOutput, SamplingParams, float | None, tuple[int, ...]]]
    _running: OrderedDict[tuple[str, int], RunningSequence]
    _live: Counter[str]
    _landing: dict[str, tuple[SamplingParams, tuple[int, ...]]]
    _events: list[TokenEvent]

    def _begin(
        self,
        request_id: str,
        lease: Lease,
        pre: Prefilled,
        sampling: SamplingParams,
        deadline: float | None,
        replay: tuple[int, ...],
    ) -> None:  # (the engine's)
        raise NotImplementedError

    def submit(
        self,
        request_id: str,
        pre: PrefillOutput,
        sampling: SamplingParams,
        deadline: float | None = None,
        replay: Sequence[int] = (),
        tenant: str = "",
        weight: float = 1.0,
    ) -> None:
        """Queue a prefilled sequence whose KV is at hand (``deadline`` on this engine's clock): admitted — its KV
        copied into its blocks — when its lease is granted. Raises :class:`LeaseTooLarge` if it can never fit its
        lease. ``replay``: the tokens a client already received from a lost replica (the first one in place of
        prefill's); they are rebuilt, not emitted, and the sequence goes on from the next one. ``tenant`` /
        ``weight``: whose lease it is, when it takes one here (no reservation: a migration, ``reserve_kv: false``)."""
        check_prefill(self.lm, pre)
        sampling, replay, need = self._needs(pre, sampling, replay)
        reserved = self._reserved.pop(request_id, False) is not False
        self._pending[request_id] = (pre, sampling, deadline, replay)
        others: list[str] = []
        try:
            if reserved:  # claim it: the estimate becomes the exact need
                others = self.pool.resize_lease(request_id, need)
            else:
                self.pool.request_lease(request_id, need, tenant=tenant, weight=weight)
        except Exception:
            del self._pending[request_id]
            self._release(request_id)  # (a claimed reservation that cannot be resized is dropped with it)
            raise
        if self.pool.granted(request_id):
            self._admit(request_id)
        self._admit_granted(others)  # (a lease made smaller lets the queue move)

    def claim(
        self,
        request_id: str,
        pre: Prefilled,
        sampling: SamplingParams,
        replay: Sequence[int] = (),
        tenant: str = "",
        weight: float = 1.0,
    ) -> list[int] | None:
        """Lease and allocate a sequence's blocks *before* its KV is here, when the pool can give them at once — its
        reservation made the exact need (if what it lacks is available now), or a new lease granted now — and return
        the blocks its hand-off must land in, in order; the sequence is then *landing* until :meth:`start` runs it
        (or :meth:`cancel` frees it). ``None`` when its lease would have to wait: nothing changed (a reservation stays
        as it was), and the caller fetches the KV and queues it with :meth:`submit`. Checks the hand-off's
        layout first; raises :class:`LeaseTooLarge` past the per-request limit."""
        check_prefill(self.lm, pre)
        if pre.layout.block_size != self.pool.block_size:
            size = pre.layout.block_size
            raise HandoffError(f"KV in blocks of {size} tokens; this pool's are {self.pool.block_size}")
        sampling, replay, need = self._needs(pre, sampling, replay)
        if request_id in self._reserved:
            lease = self.pool.lease(request_id)
            if lease is None or need - lease.reserved > self.pool.available_blocks:
                return None
            del self._reserved[request_id]
            self._admit_granted(self.pool.resize_lease(request_id, need))  # (a smaller lease lets the queue move)
        else:
            self._check_new(request_id)
            if self.pool.num_waiting or need > self.pool.available_blocks:
                return None  # (never ahead of a queued lease)
            self.pool.request_lease(request_id, need, tenant=tenant, weight=weight)
        lease = self.pool.lease(request_id)
        assert lease is not None  # granted just now
        blocks = self._allocate(lease, pre, sampling)
        self._landing[request_id] = (sampling, replay)
        return blocks

    def start(self, request_id: str, pre: Prefilled, deadline: float | None = None) -> None:
        """Run a sequence whose KV landed in the blocks :meth:`claim` gave it: its first token is emitted (or its
        replay begins) as for one admitted from :meth:`submit`."""
        sampling, replay = self._landing.pop(request_id)
        lease = self.pool.lease(request_id)
        assert lease is not None  # a landing sequence holds its lease until start or cancel
        self._begin(request_id, lease, pre, sampling, deadline, replay)

    def _check_new(self, request_id: str) -> None:
        """Refuse a request already queued, landing or running here."""
        if request_id in self._pending or request_id in self._live or request_id in self._landing:
            raise ValueError(f"request {request_id} is already known to this engine")

    def _needs(
        self, pre: Prefilled, sampling: SamplingParams, replay: Sequence[int]
    ) -> tuple[SamplingParams, tuple[int, ...], int]:
        """The resolved sampling, the replay, and the blocks the sequence's lease needs (prompt + ``max_tokens``)."""
        sampling = sampling.resolved()
        if sampling.guide is not None:  # (a guide that does not compile is refused before any KV is taken)
            compiler_for(self.lm).check(sampling.guide)
        replay = tuple(int(t) for t in replay)
        if len(replay) >= sampling.max_tokens:
            raise ValueError(f"a replay of {len(replay)} tokens leaves nothing of max_tokens={sampling.max_tokens}")
        if replay and sampling.n > 1:
            raise ValueError(f"a request of n={sampling.n} choices is not replayed")
        if len(pre.forks) != sampling.n - 1:
            raise HandoffError(f"prefill sampled {len(pre.forks) + 1} first tokens for n={sampling.n} choices")
        return sampling, replay, self.pool.blocks_for_choices(pre.layout.num_tokens, sampling.max_tokens, sampling.n)

    def cancel(self, request_id: str) -> bool:
        """Drop a sequence wherever it is and free its KV (its reservation too, if it never claimed one); True if the
        sequence was known (submitted)."""
        known = self._pending.pop(request_id, None) is not None or self._drop_running(request_id)
        known = self._landing.pop(request_id, None) is not None or known
        self._reserved.pop(request_id, None)
        self._release(request_id)
        return known

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def most_tokens_left(self) -> int:
        """The most tokens a running sequence may still generate (its ``max_tokens`` less the ``step + 1`` it has:
        prefill's first token is step 0): how long the busiest stream could go on (0: none running). Safe to read
        from another thread than the one stepping (the replica's ``stats``): it reads a snapshot of the sequences."""
        running = list(self._running.values())  # (one C-level copy: no thread switch while the dict is read)
        return max((seq.sampling.max_tokens - seq.step - 1 for seq in running), default=0)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    @property
    def num_landing(self) -> int:
        return len(self._landing)

    def has_work(self) -> bool:
        return bool(self._running or self._events)

    def _release(self, request_id: str) -> None:
        self._admit_granted(self.pool.release(request_id))

    def _drop_running(self, request_id: str) -> bool:
        """Take every running sequence of a request out of the batch; True if it had any."""
        if self._live.pop(request_id, 0) == 0:
            return False
        for key in [k for k in self._running if k[0] == request_id]:
            del self._running[key]
        return True

    def _admit_granted(self, granted: list[str]) -> None:
        """Admit the prefilled sequences among leases the pool just granted (a granted reservation waits for its
        submit: the stage is told apart)."""
        for rid in granted:
            if rid in self._pending:
                self._admit(rid)

    def _admit(self, request_id: str) -> None:
        pre, sampling, deadline, replay = self._pending.pop(request_id)
        lease = self.pool.lease(request_id)
        assert lease is not None  # granted by the pool just now
        blocks = self._allocate(lease, pre, sampling)
        self.pool.store_blocks(blocks, to_torch(pre.kv.keys, pre.kv.dtype), to_torch(pre.kv.values, pre.kv.dtype))
        self._begin(request_id, lease, pre, sampling, deadline, replay)

    def _allocate(self, lease: Lease, pre: Prefilled, sampling: SamplingParams) -> list[int]:
        """The prompt's blocks in a granted lease: the first sequence's whole span (prompt + ``max_tokens``) as one run
        when possible (attention then reads its KV through a view) — for ``n`` = 1 the whole lease —, the first
        ``prompt_blocks`` of it returned."""
        prompt_blocks, span = pre.layout.num_blocks, self.pool.blocks_for(pre.layout.num_tokens + sampling.max_tokens)
        run = self.pool.allocate_run(lease, span) if self.prefer_contiguous else None
        return run[:prompt_blocks] if run is not None else self.pool.allocate(lease, prompt_blocks)

    def _fork(self, lease: Lease, pre: Prefilled, sampling: SamplingParams) -> list[int]:
        """Another choice's block table: the prompt's full blocks shared (one more reference each), then blocks of its
        own — its share of the lease as one run when possible —, the first a copy of the prompt's partial last block."""
        prompt = pre.layout.num_tokens
        full, partial = divmod(prompt, self.pool.block_size)
        shared = lease.blocks[:full]
        own = self.pool.blocks_for(prompt + sampling.max_tokens) - full
        run = self.pool.allocate_run(lease, own) if self.prefer_contiguous else None
        mine = run if run is not None else self.pool.allocate(lease, 1 if partial else 0)
        if partial:
            self.pool.copy_block(lease.blocks[full], mine[0])
        self.pool.share(lease, shared)
        return [*shared, *mine]
