"""Decode deployment: continuous batching over the replica's paged KV pool, tokens streamed to the caller.

``generate`` is a streaming method yielding typed events (:mod:`common.protocol.handoff`): a :class:`StreamStart`
with the prompt's token ids (for usage and ``return_token_ids``), then a :class:`StreamToken` per token as the
:class:`DecodeEngine` produces it until one carries a finish reason — or a :class:`StreamAbort` when the engine ended
the sequence (deadline, failed step). The KV arrives through the replica's transport (:mod:`common.kv.transport`).
When the caller goes away (client disconnect → Serve cancels the call), the ``finally`` cancels the sequence in the
engine, which frees its KV blocks at once.

A migrated stream (its first decode replica died after tokens were sent) arrives here with ``replay``: the tokens the
client already has. The engine rebuilds the sequence through them (:class:`DecodeEngine`, *Replay*) and the stream
yields only what comes after — the start event as always, then the next token.

**KV before prefill.** The ingress calls :meth:`DecodeDeployment.reserve` before it issues prefill: the request's
blocks (prompt + ``max_tokens``, exact for text, an estimate for media) are leased from this replica's pool now, or
the call waits in the pool's queue (arrival order, batch class ``admission.batch_delay_s`` behind; bounded and
deadline-aware: :class:`common.admission.kv.KVAdmission` refuses 429 ``server_overloaded`` with a Retry-After from
the pool's drain rate, or a wait past the deadline is a 504) —
before any prefill work is spent on a request the pool cannot hold. It answers with this replica's id; the ingress
puts it in the context (``decode_replica``) and the decode router (:mod:`services.routers.pinned`) sends ``generate``
here, where :meth:`DecodeEngine.submit` claims the lease (resized to the exact need). A reservation nobody claims is
dropped by :meth:`unreserve` (the ingress, when the chain failed or was cancelled first) or at its deadline (a sweep
while any is held). Each decision is counted in ``prism_admission_total{stage="decode"}``.

Trace: the start event carries every span so far plus ``decode.transfer`` (prefill done → this call starts, the
transport's read included); the first token carries ``decode.queue`` (KV lease wait + import + first emission).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.admission.budget import rank
from common.admission.kv import KVAdmission
from common.config import PrismConfig
from common.engine.decode import DecodeEngine, TokenEvent
from common.errors import DeadlineExceeded, Overloaded
from common.kv.blocks import verify_handoff
from common.kv.pool import KVPool
from common.kv.transport import KVTransport, make_transport
from common.model.loader import load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import (
    DecodeEvent,
    KVReservation,
    PrefillOutput,
    RequestContext,
    StreamAbort,
    StreamStart,
    StreamToken,
)
from common.protocol.sampling import SamplingParams
from services.platform.loopback import bind_replica
from services.platform.metrics import Metrics
from services.stages.driver import EngineDriver

RESERVATION_SWEEP_S = 1.0
"""How often unclaimed reservations are checked against their deadlines while any is held."""


def _replica_id() -> str | None:
    """This replica's Serve id (what the decode router matches), ``None`` outside Serve (the monolith)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica
        return None


class DecodeDeployment:
    def __init__(self, config: dict[str, Any], transport: KVTransport | None = None) -> None:
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        self.lm = load_model(self.cfg.model)
        eng = self.cfg.engine
        self.pool = KVPool(
            eng.kv_pool_blocks, eng.kv_block_size, self.lm.kv_shape, self.lm.dtype, eng.max_lease_fraction
        )
        self.engine = DecodeEngine(self.lm, self.pool, max_batch=eng.max_batch)
        self.queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.cancelled = 0
        self.fetches = 0
        # Steps run in a thread of their own, never in the loop's shared pool, where the transport's fetches (and, in
        # the monolith baseline, the media stage's fetch and decode) would queue behind them.
        self.driver = EngineDriver(
            self.engine.step, self._has_work, self._deliver, executor=ThreadPoolExecutor(1, "prism-decode")
        )
        self.transport = transport or make_transport(self.cfg.server.transport)
        self.metrics = Metrics("decode")
        self.metrics.keep_fresh(self._load)
        adm = self.cfg.admission
        self.kv_admission = KVAdmission(self.pool, adm.max_waiting, adm.retry_after_s)
        self.replica_id = _replica_id()
        self._reservations: dict[str, asyncio.Future[bool]] = {}  # reservations waiting for their blocks
        self._sweeper: asyncio.Task | None = None

    async def reserve(self, ctx: RequestContext, blocks: int, admitted: bool = False) -> KVReservation:
        """Lease ``blocks`` for ``ctx``'s attempt before its prefill computes; answers once granted. Raises 429 (must
        not wait, or no request slot would be left for its ``generate``), 504 (its deadline passed while it waited),
        400 (over the per-request lease). ``admitted``: a migration's — it waits whatever the queue (refusing it would
        end a stream the client is reading); only the request-slot rule refuses it, and the ingress then migrates
        without a reservation."""
        left = ctx.check_deadline("decode")
        key, tags = ctx.key, {"tenant": ctx.tenant, "class": ctx.priority}
        async with self.driver.lock:
            try:
                # (the rank of every stage budget without the size term: the KV queue keeps arrival order within a
                # class, so a large request is never overtaken by small ones; batch behind interactive for a while)
                adm = self.cfg.admission
                order = rank(ctx.sent_at, 0, adm.aging_tokens_per_s, ctx.batch, adm.batch_delay_s)
                self._check_slots()
                if not admitted:
                    self.kv_admission.check(blocks, left, order)
                granted = self.engine.reserve(key, blocks, ctx.monotonic_deadline(), order)
            except Overloaded:
                self.metrics.inc("prism_admission_total", result="refused", reason="budget_full", **tags)
                raise
            waiter = None if granted else asyncio.get_running_loop().create_future()
            if waiter is not None:
                self._reservations[key] = waiter
        self._keep_sweeping()
        self._load()
        waited = 0.0
        if waiter is not None:
            start = time.monotonic()
            try:
                kept = await asyncio.wait_for(asyncio.shield(waiter), timeout=left)
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # granted in the instant the caller went away
                    raise asyncio.CancelledError
            except BaseException as exc:  # deadline, or the caller went away: give the place (or the grant) back
                self._reservations.pop(key, None)
                asyncio.get_running_loop().create_task(self._drop(key))
                if isinstance(exc, TimeoutError):
                    self.metrics.inc("prism_admission_total", result="refused", reason="deadline", **tags)
                    raise DeadlineExceeded("deadline exceeded waiting for KV blocks in the decode stage") from None
                raise
            if not kept:  # dropped by the sweep at its deadline (or by the ingress, which no longer waits for it)
                raise DeadlineExceeded("deadline exceeded waiting for KV blocks in the decode stage")
            waited = time.monotonic() - start
        self.metrics.inc("prism_admission_total", result="admitted", reason="waited" if waited else "immediate", **tags)
        self.metrics.observe("prism_admission_wait_seconds", waited, **{"class": ctx.priority})
        return KVReservation(self.replica_id, blocks, waited)

    def _check_slots(self) -> None:
        """Every reservation's ``generate`` must find a request slot on this replica, where the decode router sends
        it and nowhere else. A reservation takes one slot at a time — its ``reserve`` call while it waits, then its
        ``generate`` — and a stream one: refuse a reservation that would commit more than ``max_ongoing_requests``
        less one (kept for ``unreserve`` and ``stats``). Otherwise waiting reservations could take every slot while the
        granted ones' ``generate`` calls wait for one: each side waiting for the other."""
        slots = self.cfg.deployments.decode.max_ongoing_requests
        committed = len(self.queues) + self.engine.num_reserved
        if committed + 2 > slots:
            raise Overloaded(
                f"the decode replica has {committed} of its {slots} request slots committed (streams and KV "
                "reservations); retry later",
                retry_after_s=self.kv_admission.retry_after_s(1),
            )

    async def unreserve(self, ctx: RequestContext) -> bool:
        """Drop ``ctx``'s reservation if no ``generate`` claimed it (the ingress: its chain failed or was cancelled)."""
        return await self._drop(ctx.key)

    async def _drop(self, key: str) -> bool:
        async with self.driver.lock:
            dropped = self.engine.unreserve(key)
        self._pool_changed()
        return dropped

    def _pool_changed(self) -> None:
        """Leases changed on the event loop (blocks back, a claim resized): wake the reservations granted, step the
        sequences admitted."""
        self._wake()
        self._load()
        self.driver.poke()

    def _wake(self) -> None:
        """Resolve the waiting reservations that the pool granted (True) or that were dropped meanwhile (False)."""
        self.kv_admission.sample()
        for key, waiter in list(self._reservations.items()):
            granted = self.engine.reservation_granted(key)
            if granted or not self.engine.is_reserved(key):
                del self._reservations[key]
                if not waiter.done():
                    waiter.set_result(granted)

    def _keep_sweeping(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Drop reservations whose deadline passed unclaimed (an ingress that died, a chain that never reached
        decode) and time out sequences that waited for their lease past their deadline; ends when neither is left."""
        while self.engine.num_reserved or self.engine.num_waiting:
            await asyncio.sleep(RESERVATION_SWEEP_S)
            async with self.driver.lock:
                self.engine.expire_reservations()
                self.engine.expire_waiting()
            self._pool_changed()

    def _has_work(self) -> bool:
        # Only running sequences and undelivered events need steps: a sequence waiting for its lease is admitted by
        # whatever frees blocks (a step, or a cancel / unreserve / expiry here, which poke the driver), and timed out
        # by the sweep when nothing runs — stepping for it would spin while reservations hold the pool.
        return self.engine.has_work()

    async def generate(
        self, pre: Traced[Any] | Any, sampling: SamplingParams, ctx: RequestContext, replay: tuple[int, ...] = ()
    ) -> AsyncIterator[DecodeEvent]:
        timeline = Timeline.after(pre, ctx.sent_at)
        ctx.check_deadline("decode")
        handle, fetch = unwrap(pre), self.transport.fetch

        def fetch_checked() -> PrefillOutput:  # (a few ms of CRC per few MB of KV: off the event loop)
            out = fetch(handle)
            verify_handoff(out, ctx.key)  # never a stale or altered payload into the pool
            return out

        key = ctx.key
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.queues[key] = queue
        tokens = len(replay)
        try:  # (from the fetch on: a hand-off refused before submit still frees this attempt's reservation)
            prefilled = await asyncio.to_thread(fetch_checked)
            self.fetches += 1
            backend = self.transport.name
            where = {"replica": self.replica_id} if self.replica_id is not None else {}
            transfer = timeline.mark("decode.transfer", backend=backend, bytes=prefilled.kv.nbytes, **where)
            self.metrics.transfer(backend, "kv", prefilled.kv.nbytes, transfer.duration_s)
            async with self.driver.lock:
                self.engine.submit(key, prefilled, sampling, deadline=ctx.monotonic_deadline(), replay=replay)
            self._pool_changed()  # (its own first token; a reservation made exact may let others in)
            if self.engine.num_waiting:
                self._keep_sweeping()  # (waiting for its lease: timed out by the sweep if nothing steps)
            yield StreamStart(tuple(prefilled.prompt_token_ids.tolist()), tuple(timeline.spans))
            while True:
                event = await queue.get()
                if event.token_id is None:  # the engine ended it: deadline or a failed step
                    yield StreamAbort("timeout" if event.finish_reason == "timeout" else "error")
                    return
                spans: tuple = ()
                if tokens == len(replay) and replay:  # lease wait + import + the replayed steps: not a queue
                    spans = (timeline.mark("decode.replay", tokens=len(replay)),)
                elif tokens == 0:
                    waited = timeline.mark("decode.queue")
                    spans = (waited,)
                    self.metrics.observe("prism_stage_queue_seconds", transfer.duration_s + waited.duration_s)
                tokens += 1
                finish = event.finish_reason
                kv_blocks = self.pool.blocks_for(prefilled.kv.num_tokens + tokens) if finish else 0
                yield StreamToken(event.token_id, finish, spans, kv_blocks)  # type: ignore[arg-type]
                if finish is not None:
                    return
        finally:
            self.queues.pop(key, None)
            async with self.driver.lock:
                if self.engine.cancel(key):  # still running: the caller went away
                    self.cancelled += 1
            self._pool_changed()
            if tokens > len(replay):
                self.metrics.observe("prism_stage_work_seconds", time.time() - timeline.last)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self.queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)
        if self._reservations or events:
            self._wake()  # finished sequences freed blocks: waiting reservations may be granted

    def _load(self) -> None:
        running, waiting = self.engine.num_running, self.engine.num_waiting
        self.metrics.load(len(self.queues), running + waiting + self.engine.num_reserved)
        self.metrics.set("prism_kv_blocks_used", self.pool.used_blocks)
        self.metrics.set("prism_kv_blocks_free", self.pool.free_blocks)

    async def stats(self) -> dict[str, int | str]:
        return {
            "kv_blocks_used": self.pool.used_blocks,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "cancelled": self.cancelled,
            "fetches": self.fetches,
            "replayed_tokens": self.engine.replayed,
            "replay_mismatches": self.engine.replay_mismatches,
            "reserved": self.engine.num_reserved,
            "transport": self.transport.name,
            "pid": os.getpid(),  # (which replica answered: make chaos reads every replica's KV through this)
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            # (reservations are work on its way: streams to come and the blocks promised to them)
            "queue_depth": float(self.engine.num_running + self.engine.num_waiting + self.engine.num_reserved),
            "kv_used_fraction": self.pool.committed_blocks / self.pool.num_blocks,
        }
