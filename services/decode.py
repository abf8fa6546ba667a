"""Decode deployment: continuous batching over the replica's paged KV pool, tokens streamed to the caller.

``generate`` is a streaming method: it yields the prompt's token ids first (for usage and ``return_token_ids``), then
each token as the :class:`DecodeEngine` produces it. When the caller goes away (client disconnect → Serve cancels
the call), the ``finally`` cancels the sequence in the engine, which frees its KV blocks at once.

Trace: the first item also carries every span so far plus ``decode.transfer`` (prefill done → this call starts, the
NIXL read included); the first token's item carries ``decode.queue`` (KV lease wait + import + first emission).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from common.config import PrismConfig
from common.engine.decode import DecodeEngine, TokenEvent
from common.errors import HandoffError
from common.kv.nixl_transport import NixlKVReceiver, RemotePrefillOutput
from common.kv.pool import KVPool
from common.model.loader import load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from services.metrics import Metrics
from services.runtime import EngineDriver, check_deadline, monotonic_deadline


class DecodeDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = PrismConfig.model_validate(config)
        self.lm = load_model(self.cfg.model)
        eng = self.cfg.engine
        self.pool = KVPool(
            eng.kv_pool_blocks, eng.kv_block_size, self.lm.kv_shape, self.lm.dtype, eng.max_lease_fraction
        )
        self.engine = DecodeEngine(self.lm, self.pool, max_batch=eng.max_batch)
        self.queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self.cancelled = 0
        self.nixl_fetches = 0
        self.driver = EngineDriver(self.engine.step, self._has_work, self._deliver)
        self.nixl = NixlKVReceiver() if self.cfg.server.transport == "nixl" else None
        self.metrics = Metrics("decode")
        self.metrics.keep_fresh(self._load)

    def _has_work(self) -> bool:
        return self.engine.has_work() or self.engine.num_waiting > 0

    async def generate(
        self,
        pre: Traced[PrefillOutput | RemotePrefillOutput] | PrefillOutput | RemotePrefillOutput,
        sampling: SamplingParams,
        request_id: str,
        deadline: float,
        sent_at: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        timeline = Timeline.after(pre, sent_at if sent_at is not None else time.time())
        check_deadline(deadline, "decode")
        prefilled, backend = await self._receive(unwrap(pre))
        transfer = timeline.mark("decode.transfer", backend=backend, bytes=prefilled.kv.nbytes)
        self.metrics.transfer(backend, "kv", prefilled.kv.nbytes, transfer.duration_s)
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.queues[request_id] = queue
        tokens = 0
        try:
            async with self.driver.lock:
                self.engine.submit(request_id, prefilled, sampling, deadline=monotonic_deadline(deadline))
            self._load()
            self.driver.poke()
            yield {"prompt_token_ids": prefilled.prompt_token_ids.tolist(), "spans": tuple(timeline.spans)}
            while True:
                event = await queue.get()
                item: dict[str, Any] = {"token_id": event.token_id, "finish_reason": event.finish_reason}
                if tokens == 0:
                    waited = timeline.mark("decode.queue")
                    item["spans"] = (waited,)
                    self.metrics.observe("prism_stage_queue_seconds", transfer.duration_s + waited.duration_s)
                tokens += event.token_id is not None
                if event.finish_reason is not None:
                    item["kv_blocks"] = self.pool.blocks_for(prefilled.kv.num_tokens + tokens)
                    yield item
                    return
                yield item
        finally:
            self.queues.pop(request_id, None)
            async with self.driver.lock:
                if self.engine.cancel(request_id):  # still running: the caller went away
                    self.cancelled += 1
            self._load()
            if tokens:
                self.metrics.observe("prism_stage_work_seconds", time.time() - timeline.last)

    async def _receive(self, pre: PrefillOutput | RemotePrefillOutput) -> tuple[PrefillOutput, str]:
        if not isinstance(pre, RemotePrefillOutput):
            return pre, "object_store"
        if self.nixl is None:
            raise HandoffError("received a NIXL KV descriptor but this replica's transport is object_store")
        out = await asyncio.to_thread(self.nixl.fetch, pre)
        self.nixl_fetches += 1
        return out, "nixl"

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

    async def stats(self) -> dict[str, int]:
        return {
            "kv_blocks_used": self.pool.used_blocks,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "cancelled": self.cancelled,
            "nixl_fetches": self.nixl_fetches,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(self.engine.num_running + self.engine.num_waiting),
            "kv_used_fraction": self.pool.used_blocks / self.pool.num_blocks,
        }
