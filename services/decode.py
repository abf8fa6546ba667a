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

from common.config import PrismConfig
from common.engine.decode import DecodeEngine, TokenEvent
from common.kv.blocks import verify_handoff
from common.kv.pool import KVPool
from common.kv.transport import KVTransport, make_transport
from common.model.loader import load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import (
    DecodeEvent,
    PrefillOutput,
    RequestContext,
    StreamAbort,
    StreamStart,
    StreamToken,
)
from common.protocol.sampling import SamplingParams
from services.loopback import bind_replica
from services.metrics import Metrics
from services.runtime import EngineDriver


class DecodeDeployment:
    def __init__(self, config: dict[str, Any], transport: KVTransport | None = None) -> None:
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.loopback)
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

    def _has_work(self) -> bool:
        return self.engine.has_work() or self.engine.num_waiting > 0

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

        prefilled = await asyncio.to_thread(fetch_checked)
        self.fetches += 1
        backend = self.transport.name
        transfer = timeline.mark("decode.transfer", backend=backend, bytes=prefilled.kv.nbytes)
        self.metrics.transfer(backend, "kv", prefilled.kv.nbytes, transfer.duration_s)
        key = ctx.key
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.queues[key] = queue
        tokens = len(replay)
        try:
            async with self.driver.lock:
                self.engine.submit(key, prefilled, sampling, deadline=ctx.monotonic_deadline(), replay=replay)
            self._load()
            self.driver.poke()
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
            self._load()
            if tokens > len(replay):
                self.metrics.observe("prism_stage_work_seconds", time.time() - timeline.last)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self.queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def _load(self) -> None:
        running, waiting = self.engine.num_running, self.engine.num_waiting
        self.metrics.load(len(self.queues), running + waiting)
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
            "transport": self.transport.name,
            "pid": os.getpid(),  # (which replica answered: make chaos reads every replica's KV through this)
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(self.engine.num_running + self.engine.num_waiting),
            "kv_used_fraction": self.pool.used_blocks / self.pool.num_blocks,
        }
