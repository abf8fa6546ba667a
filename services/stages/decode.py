"""Decode deployment: continuous batching over the replica's paged KV pool, tokens streamed to the caller.

``generate`` is a streaming method yielding typed events (:mod:`common.protocol.handoff`): a :class:`StreamStart`
with the prompt's token ids (for usage and ``return_token_ids``), then a :class:`StreamToken` per token as the
:class:`DecodeEngine` produces it until one carries a finish reason — or a :class:`StreamAbort` when the engine ended
the sequence (deadline, failed step). The KV arrives through the replica's transport (:mod:`common.kv.transport`),
whose pool arrays it registered once at start (``attach``): when the sequence's blocks can be had at once
(:meth:`DecodeEngine.claim`) the KV lands straight in them — one READ with NIXL, one copy out of the store's shared
memory with the object store — and is checked against the attempt's seal where it lies; otherwise it is fetched as
arrays and queued (:meth:`DecodeEngine.submit`).
When the caller goes away (client disconnect → Serve cancels the call), the ``finally`` cancels the sequence in the
engine, which frees its KV blocks at once.

A migrated stream (its first decode replica died after tokens were sent) arrives here with ``ctx.replay``: the tokens
the client already has. The engine rebuilds the sequence through them (:class:`DecodeEngine`, *Replay*) and the stream
yields only what comes after — the start event as always, then the next token.

The first token rides in the start event (:attr:`StreamStart.first`) whenever the engine had it by the time the
stream starts — always, unless the sequence waits for its KV lease: a Serve stream sends each item on its own, and
the second item pays for the decode step the replica begins meanwhile.

**KV before prefill.** The ingress calls :meth:`DecodeDeployment.reserve` before it issues prefill: the request's
blocks (prompt + ``max_tokens``, exact for text, an estimate for media) are admitted through the replica's
:class:`common.admission.kv.KVGate` — the admission protocol every stage budget speaks — leased from this replica's
pool now, or the call waits in the pool's queue (arrival order, batch class ``admission.batch_delay_s`` behind;
bounded and deadline-aware: 429 ``server_overloaded`` with a Retry-After from the pool's drain rate, or a wait past
the deadline is a 504) — before any prefill work is spent on a request the pool cannot hold. It answers with this
replica's id; the ingress puts it in the context (``decode_replica``) and the decode router
(:mod:`services.routers.pinned`) sends ``generate`` here, where :meth:`DecodeEngine.submit` claims the lease (resized to
the exact need). A reservation nobody claims is dropped by :meth:`unreserve` (the ingress, when the chain failed or was
cancelled first) or at its deadline (a sweep while any is held). Each decision is counted by the stage admission's
recorder (:mod:`common.admission.record`).

Trace: the start event carries every span so far plus ``decode.transfer`` (prefill done → this call starts, the
transport's read included); the first token carries ``decode.queue`` (KV lease wait + import + first emission).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from common.admission.kv import KVAdmission, KVGate
from common.admission.record import AdmissionRecorder
from common.admission.stage import StageAdmission
from common.config import PrismConfig
from common.engine.decode import DecodeEngine
from common.engine.sequence import TokenEvent
from common.errors import Overloaded
from common.kv.blocks import check_key, check_landed, verify_handoff
from common.kv.landing import Landing
from common.kv.pool import KVPool
from common.kv.transport import KVTransport, make_transport
from common.model.loader import LoadedModel, load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import (
    DecodeEvent,
    KVReservation,
    Prefilled,
    PrefillOutput,
    RequestContext,
    StreamAbort,
    StreamStart,
    StreamToken,
)
from common.protocol.sampling import SamplingParams
from services.platform.loopback import bind_replica
from services.platform.metrics import Metrics
from services.stages.driver import EngineDriver, check_engines
from services.stages.threads import compile_guide, finish_in_thread
from services.stages.upstream import Pending, arrived

RESERVATION_SWEEP_S = 1.0
"""How often unclaimed reservations are checked against their deadlines while any is held."""
INLINE_LAND_BYTES = 1 << 20
"""A hand-off up to this size lands on the event loop (~0.1 ms of copy and hash here, less than a thread hop)."""


@dataclass
class _Stream:
    """One ``generate`` call: the engine's events for its sequence, and how many tokens the sequence has so far (the
    replayed ones of a migration included)."""

    ctx: RequestContext
    timeline: Timeline
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    tokens: int = 0
    held: dict[str, int] = field(default_factory=dict)
    """For ``n`` > 1: the blocks the pool held for the request as its choices started (:meth:`_choices_held`)."""


def _replica_id() -> str | None:
    """This replica's Serve id (what the decode router matches), ``None`` outside Serve (the monolith)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica
        return None


class DecodeDeployment:
    def __init__(
        self,
        config: dict[str, Any],
        transport: KVTransport | None = None,
        lm: LoadedModel | None = None,
        grouped: bool = False,
    ) -> None:
        """``transport``: how the KV arrives (the model's by default); ``lm``: the model, when a grouped replica
        loaded it once for its stages (:mod:`services.stages.group`); ``grouped``: the stage shares its replica
        with the prefill, whose call reserves and streams in one Serve request (no slot to keep for a later
        ``generate``)."""
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        self.lm = lm or load_model(self.cfg.model)
        self.grouped = grouped
        eng = self.cfg.engine
        self.pool = KVPool(
            eng.kv_pool_blocks, eng.kv_block_size, self.lm.kv_shape, self.lm.dtype, eng.max_lease_fraction
        )
        self.engine = DecodeEngine(self.lm, self.pool, max_batch=eng.max_batch)
        self.queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.awaiting: set[str] = set()
        """Attempts whose ``generate`` waits here for its prefill's result (sent early: a request slot each)."""
        self.cancelled = 0
        self.fetches = 0
        # Steps run in a thread of their own, never in the loop's shared pool, where the transport's fetches (and, in
        # the monolith baseline, the media stage's fetch and decode) would queue behind them.
        self.driver = EngineDriver(
            self.engine.step, self._has_work, self._deliver, executor=ThreadPoolExecutor(1, "prism-decode")
        )
        self.transport = transport or make_transport(self.cfg.transport)
        self.pool_arrays = self.pool.arrays()
        self.transport.prepare(sends=False, receives=True)  # (not on the first request's time)
        self.transport.attach(self.pool_arrays)  # (NIXL registers the pool here, once: hand-offs land in it)
        self.metrics = Metrics("decode")
        self.metrics.keep_fresh(self._load)
        adm = self.cfg.admission
        self.kv_admission = KVAdmission(self.pool, adm.max_waiting, adm.retry_after_s)
        self.kv = KVGate(
            self.engine,
            self.kv_admission,
            self.driver.lock,
            self._pool_changed,
            self._check_slots,
            RESERVATION_SWEEP_S,
            hold_s=adm.reservation_hold_s,
        )
        self.admission = StageAdmission(self.kv, adm, AdmissionRecorder(self.metrics, "decode"))
        self.replica_id = _replica_id()

    async def reserve(self, ctx: RequestContext, blocks: int) -> KVReservation:
        """Lease ``blocks`` for ``ctx``'s attempt before its prefill computes, through the replica's KV gate; answers
        once granted. Raises 429 (must not wait, or no request slot would be left for its ``generate``), 504 (its
        deadline passed while it waited), 400 (over the per-request lease). A migration's (``ctx.migration``) waits
        whatever the queue (refusing it would end a stream the client is reading); only the request-slot rule refuses
        it, and the ingress then migrates without a reservation. The rank is every stage budget's without the size
        term: the KV queue keeps arrival order within a tenant and class, so a large request is never overtaken by its
        tenant's small ones."""
        ctx.check_deadline("decode")
        grant = await self.admission.admit(ctx, blocks, 0, refuse=not ctx.migration)
        return KVReservation(self.replica_id, blocks, grant.waited_s)

    def _check_slots(self) -> None:
        """Every reservation's ``generate`` must find a request slot on this replica, where the decode router sends
        it and nowhere else. A reservation takes one slot at a time — its ``reserve`` call while it waits, then its
        ``generate`` (sent before the prefill finished, it waits here in that same slot; if the reservation lapsed
        meanwhile, the waiting call still holds it: counted apart) — and a stream one: refuse a reservation that would
        commit more than ``max_ongoing_requests`` less one (kept for ``unreserve`` and ``stats``). Otherwise waiting
        reservations could take every slot while the granted ones' ``generate`` calls wait for one: each side waiting
        for the other."""
        if self.grouped:  # (the group's call holds its one slot from its reservation to its stream's end)
            return
        slots = self.cfg.deployments.decode.max_ongoing_requests
        lapsed = sum(not self.engine.is_reserved(key) for key in self.awaiting)  # (a slot no reservation counts now)
        committed = len(self.queues) + self.engine.num_reserved + lapsed
        if committed + 2 > slots:
            raise Overloaded(
                f"the decode replica has {committed} of its {slots} request slots committed (streams and KV "
                "reservations); retry later",
                retry_after_s=self.kv_admission.retry_after_s(1),
            )

    async def unreserve(self, ctx: RequestContext) -> bool:
        """Drop ``ctx``'s reservation if no ``generate`` claimed it (the ingress: its chain failed or was cancelled)."""
        return await self.kv.drop(ctx.key)

    def _pool_changed(self) -> None:
        """Leases changed on the event loop (blocks back, a claim resized): wake the reservations granted, step the
        sequences admitted."""
        self.kv.wake()
        self._load()
        self.driver.poke()

    def _has_work(self) -> bool:
        # Only running sequences and undelivered events need steps: a sequence waiting for its lease is admitted by
        # whatever frees blocks (a step, or a cancel / unreserve / expiry here, which poke the driver), and timed out
        # by the sweep when nothing runs — stepping for it would spin while reservations hold the pool.
        return self.engine.has_work()

    async def generate(
        self, pre: Traced[Any] | Any, sampling: SamplingParams, ctx: RequestContext
    ) -> AsyncIterator[DecodeEvent]:
        """The sequence's events (see the module docstring); a migration's (``ctx.replay``) rebuilds the tokens its
        client already has, and its stream goes on from the next one. ``pre``: the prefill's result, or a
        :class:`~services.stages.upstream.Pending` one (the call was sent while the prefill worked)."""
        pre = await self._arrived(pre, ctx.key)
        stream = _Stream(ctx, Timeline.after(pre, ctx.sent_at), tokens=len(ctx.replay))
        ctx.check_deadline("decode")
        self.queues[ctx.key] = stream.queue
        try:  # (from the fetch on: a hand-off refused before submit still frees this attempt's reservation)
            prefilled, transfer_s = await self._import(unwrap(pre), sampling, stream)
            prompt = tuple(prefilled.prompt_token_ids.tolist())
            start = StreamStart(prompt, tuple(stream.timeline.spans), self.replica_id, ctx.reservation)
            ready = not stream.queue.empty()  # (its first token is here already: it rides with the start)
            tokens = self._tokens(stream, prefilled.layout.num_tokens, transfer_s, sampling.n)
            first = await anext(tokens) if ready else None
            if isinstance(first, StreamToken):
                start, first = replace(start, first=first), None
            yield start
            if first is not None:  # (an abort: an event of its own, after the start as always)
                yield first
            async for event in tokens:
                yield event
        finally:
            self.queues.pop(ctx.key, None)
            async with self.driver.lock:
                if self.engine.cancel(ctx.key):  # still running: the caller went away
                    self.cancelled += 1
            self._pool_changed()
            if stream.tokens > len(ctx.replay):
                self.metrics.observe("prism_stage_work_seconds", time.time() - stream.timeline.last)

    async def _arrived(self, pre: Any, key: str) -> Any:
        """The prefill's result: ``pre`` itself, or, for a call sent before the prefill finished, its result once it
        exists (:func:`~services.stages.upstream.arrived`), the call counted in :attr:`awaiting` meanwhile."""
        if not isinstance(pre, Pending):
            return pre
        self.awaiting.add(key)
        try:
            return await arrived(pre)
        finally:
            self.awaiting.discard(key)

    async def _import(self, handle: Any, sampling: SamplingParams, stream: _Stream) -> tuple[Prefilled, float]:
        """Bring the prefilled KV in through the transport and start the sequence; returns the prefill's result and
        the transfer's seconds. When the sequence's lease can be had at once (its reservation, or free blocks) the KV
        lands straight in the blocks it was given (:meth:`DecodeEngine.claim`, :meth:`_land`); otherwise it is
        fetched here as arrays and queued with them (:meth:`DecodeEngine.submit`), copied in when the lease comes.
        Either way what arrived is checked against the attempt's seal — key first, bytes where they lie — before a
        token is made from it (off the event loop)."""
        ctx, transport = stream.ctx, self.transport
        # (compiled on the grammar thread, outside the engine's lock: claim/submit below then find it cached)
        await compile_guide(self.lm, sampling.guide)
        pre = await asyncio.to_thread(transport.open, handle) if transport.open_blocks else transport.open(handle)
        check_key(pre, ctx.key)  # never another attempt's KV, not even for a moment in the pool
        whose = {"tenant": ctx.tenant, "weight": self.cfg.admission.quota(ctx.tenant).weight}  # (an unreserved lease's)
        async with self.driver.lock:
            blocks = self.engine.claim(ctx.key, pre, sampling, replay=ctx.replay, **whose)
        if blocks is not None:
            await self._land(pre, blocks)
        else:
            prefilled = await asyncio.to_thread(self._fetch_checked, pre, ctx.key)
        self.fetches += 1
        where = {"replica": self.replica_id} if self.replica_id is not None else {}
        nbytes = pre.layout.nbytes
        transfer = stream.timeline.mark("decode.transfer", backend=transport.name, bytes=nbytes, **where)
        self.metrics.transfer(transport.name, "kv", nbytes, transfer.duration_s)
        deadline = ctx.monotonic_deadline()
        async with self.driver.lock:
            if blocks is not None:
                self.engine.start(ctx.key, pre, deadline)
            else:
                self.engine.submit(ctx.key, prefilled, sampling, deadline=deadline, replay=ctx.replay, **whose)
            stream.held = self._choices_held(ctx.key, sampling.n)
            self._deliver(self.engine.take_events())  # (its first token now, not after the next forward pass)
        self._pool_changed()  # (its own first token; a reservation made exact may let others in)
        if self.engine.num_waiting:
            self.kv.keep_sweeping()  # (waiting for its lease: timed out by the sweep if nothing steps)
        return pre, transfer.duration_s

    async def _land(self, pre: Prefilled, blocks: list[int]) -> None:
        """Move the KV into its pool blocks and check the bytes there against the seal. A caller that goes away
        meanwhile still waits for the move to end: the blocks go back to the pool only when no byte can still
        arrive in them."""
        landing = Landing.of(pre.layout, self.pool_arrays, blocks)

        def land_checked() -> None:
            check_landed(pre, self.transport.land(pre, landing))

        if self.transport.lands_from_memory and pre.layout.nbytes <= INLINE_LAND_BYTES:
            land_checked()  # (a copy and hash of this size take less than a worker thread's round trip)
            return
        await finish_in_thread(land_checked)

    def _fetch_checked(self, pre: Prefilled, key: str) -> PrefillOutput:
        out = self.transport.fetch(pre)
        verify_handoff(out, key)  # (the bytes fetched against the seal its fields carry over)
        return out

    async def _tokens(
        self, stream: _Stream, prompt_tokens: int, transfer_s: float, n: int
    ) -> AsyncIterator[DecodeEvent]:
        """The engine's events for the request's ``n`` sequences as stream events, until each has finished (or the
        engine aborts them). A finishing choice's ``kv_blocks`` are its own (the prompt's full blocks counted once,
        with choice 0)."""
        replay, timeline = stream.ctx.replay, stream.timeline
        tokens, running = [0] * n, n
        while True:
            event = await stream.queue.get()
            if event.token_id is None:  # the engine ended it: deadline or a failed step
                yield StreamAbort("timeout" if event.finish_reason == "timeout" else "error")
                return
            spans: tuple = ()
            if stream.tokens == len(replay) and replay:  # lease wait + import + the replayed steps: not a queue
                spans = (timeline.mark("decode.replay", tokens=len(replay)),)
            elif stream.tokens == 0:
                waited = timeline.mark("decode.queue", **stream.held)
                spans = (waited,)
                self.metrics.observe("prism_stage_queue_seconds", transfer_s + waited.duration_s)
            stream.tokens += 1
            tokens[event.index] += 1
            finish = event.finish_reason
            kv_blocks = 0
            if finish is not None:
                shared = prompt_tokens // self.pool.block_size if event.index else 0
                kv_blocks = self.pool.blocks_for(prompt_tokens + len(replay) + tokens[event.index]) - shared
                running -= 1
            yield StreamToken(event.token_id, finish, spans, kv_blocks, event.logprob, event.index)  # type: ignore[arg-type]
            if not running:
                return

    def _choices_held(self, key: str, n: int) -> dict[str, int]:
        """For ``n`` > 1, what the pool holds for the request as its choices start (the trace's ``decode.queue``
        attributes): its blocks, and how many of them its choices share (the prompt's full blocks, held once). Empty
        when its lease is not held (still queued, or every choice ended at its first token)."""
        lease = self.pool.lease(key)
        if n == 1 or lease is None:
            return {}
        shared = {b for b in lease.blocks if self.pool.refcount(b) > 1}
        return {"choices": n, "kv_blocks_held": lease.allocated, "kv_blocks_shared": len(shared)}

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self.queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
        if self.kv.waiting or events:
            self.kv.wake()  # finished sequences freed blocks: waiting reservations may be granted

    def _load(self) -> None:
        running, waiting = self.engine.num_running, self.engine.num_waiting
        self.metrics.load(len(self.queues), running + waiting + self.engine.num_reserved)
        self.metrics.set("prism_kv_blocks_used", self.pool.used_blocks)
        self.metrics.set("prism_kv_blocks_free", self.pool.free_blocks)
        self.metrics.grammar(self.engine.masks.seconds, self.engine.masks.steps)

    async def stats(self) -> dict[str, int | str]:
        return {
            "kv_blocks_used": self.pool.used_blocks,
            "kv_blocks_shared": self.pool.shared_blocks,
            "running": self.engine.num_running,
            "most_tokens_left": self.engine.most_tokens_left,
            "waiting": self.engine.num_waiting,
            "cancelled": self.cancelled,
            "fetches": self.fetches,
            "replayed_tokens": self.engine.replayed,
            "replay_mismatches": self.engine.replay_mismatches,
            "reserved": self.engine.num_reserved,
            "transport": self.transport.name,
            "pid": os.getpid(),  # (which replica answered: make chaos reads every replica's KV through this)
        }

    def check_health(self) -> None:
        """Serve's health check: unhealthy once decode steps failed several times in a row (the engine ends the
        sequences of a failed step itself; the driver sees a step that raised): :func:`check_engines`."""
        check_engines("decode", [self.engine.failed_steps, self.driver.failures])

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            # (reservations are work on its way: streams to come and the blocks promised to them)
            "queue_depth": float(self.engine.num_running + self.engine.num_waiting + self.engine.num_reserved),
            "kv_used_fraction": self.pool.committed_blocks / self.pool.num_blocks,
        }
