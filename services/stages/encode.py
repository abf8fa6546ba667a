"""Encode deployment: vision tower + projector behind the encoder cache and the shape-bucketed batcher.

Requests from many callers share batches: each call submits its items to the :class:`EncodeEngine` and awaits a
future; the driver loop encodes one batch per step. Before submitting, a call is admitted against the replica's patch
budget (``admission.encode_patch_budget``; only the patches the encoder cache does not hold count, so cache hits
never wait) — it waits in its tenant's queue, the tenants served fairly (:mod:`common.fair`), each queue in
rank order (fewest patches first, with aging; batch class behind interactive) or gets
429 / 504 (:mod:`common.admission.stage`); inside the engine its cache misses are batched by the same rank. A
cancelled call (client gone) removes its queued items; items whose deadline passes in the queue are dropped before the
next batch (504).

Trace: ``encode.transfer`` (media done → this call starts: the pixels' hand-off), ``encode.queue`` (waiting for a
batch), ``encode`` (the batch that finished it; encoder-cache hits/misses and visual tokens as attributes).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.admission.stage import budget_admission
from common.cache.encoder_cache import EncoderCache
from common.config import PrismConfig
from common.engine.encode import EncodeEngine
from common.kv.transport import KVTransport, make_transport
from common.media.stage import decode_options
from common.model.loader import LoadedModel, load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import ProcessedMedia, RequestContext, VisualEmbeddings
from common.sched.encoder_batcher import EncoderBatcher
from services.platform.loopback import bind_replica
from services.platform.memory import keep_freed_heap
from services.platform.metrics import Metrics
from services.stages.driver import AwaitedEngine, check_engines
from services.stages.releaser import Releaser
from services.stages.threads import nice_process, nice_thread


class EncodeDeployment:
    def __init__(
        self,
        config: dict[str, Any],
        transport: KVTransport | None = None,
        lm: LoadedModel | None = None,
        grouped: bool = False,
        pixels_in_process: bool = False,
    ) -> None:
        """``transport``: how the embeddings travel to prefill (the model's by default); ``lm``: the model, when a
        grouped replica loaded it once for its stages; ``grouped``: the stage shares its replica with others
        (:mod:`services.stages.group`), whom the encoder's priority must not reach — only its own thread is niced;
        ``pixels_in_process``: the media stage is in the same replica (the pixels' hand-off is a call, not a copy)."""
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        keep_freed_heap(self.cfg.deployments.encode.heap_keep_bytes)  # (activations: no page faults per request)
        self.lm = lm or load_model(self.cfg.model)
        self.nice = self.cfg.deployments.encode.cpu_nice
        if not grouped:
            nice_process(self.nice)
        eng = self.cfg.engine
        self.cache = None
        if eng.encoder_cache_bytes:
            self.cache = EncoderCache(eng.encoder_cache_bytes, eng.shared_cache_scope)
        batcher = EncoderBatcher(patch_budget=eng.encoder_patch_budget, batch_delay_s=self.cfg.admission.batch_delay_s)
        self.engine = EncodeEngine(self.lm, batcher, self.cache, time.monotonic)
        self.options = decode_options(self.cfg.media)
        # The vision tower steps in a thread of its own (niced once, when it starts), never in the loop's shared pool:
        # media work in the same process (the monolith baseline) must not wait behind a batch, nor a batch behind it.
        executor = ThreadPoolExecutor(1, "prism-encode", initializer=nice_thread, initargs=(self.nice,))
        self.runner = AwaitedEngine(
            self.engine.step,
            self.engine.has_work,
            dict.items,
            self.engine.cancel,
            self.engine.expire,
            "encode",
            executor,
        )
        self.metrics = Metrics("encode")
        self.pixels_backend = "in_process" if pixels_in_process else "object_store"
        self.transport = transport or make_transport(self.cfg.transport)  # (how the embeddings travel to prefill)
        self.transport.prepare(sends=True, receives=False)  # (not on the first request's time)
        self.releaser = Releaser(self.transport)
        adm = self.cfg.admission
        self.admission = budget_admission("encode", "patches", adm.encode_patch_budget, adm, self.metrics)
        self.metrics.keep_fresh(self._load)

    async def encode(
        self,
        media: Traced[list[ProcessedMedia]] | list[ProcessedMedia],
        ctx: RequestContext,
    ) -> Traced[Any]:
        """The items' visual embeddings, as the transport's handle (the list itself over the object store)."""
        timeline = Timeline.after(media, ctx.sent_at)
        items = unwrap(media)
        nbytes = sum(int(m.pixel_values.nbytes) for m in items)
        transfer = timeline.mark("encode.transfer", backend=self.pixels_backend, bytes=nbytes)
        self.metrics.transfer(self.pixels_backend, "pixels", nbytes, transfer.duration_s)
        if not items:
            return timeline.wrap([])
        ctx.check_deadline("encode")
        patches = self.engine.uncached_patches(items, ctx.tenant, self.options)
        try:
            async with self.admission.held(ctx, patches, patches):
                out = await self.runner.run(ctx.key, lambda: self._submit(ctx, items))
        finally:
            stats = self.engine.pop_stats(ctx.key)
            self._load()
        hits, misses = (stats.cache_hits, stats.cache_misses) if stats else (0, 0)
        queue = timeline.mark_until("encode.queue", stats.started_at if stats else None)
        work = timeline.mark(
            "encode",
            items=len(items),
            visual_tokens=sum(e.num_visual_tokens for e in out),
            encoder_cache_hits=hits,
            encoder_cache_misses=misses,
        )
        self.metrics.stage_time(transfer.duration_s + queue.duration_s, work.duration_s)
        if self.cache is not None:
            self.metrics.cache_lookups("encoder", hits, misses)
            self.metrics.cache_bytes("encoder", self.cache.stats().bytes)
        handle = self.transport.send_embeddings(out, expires_at=ctx.deadline)
        self.releaser.kick()
        return timeline.wrap(handle)

    def _submit(self, ctx: RequestContext, items: list[ProcessedMedia]) -> list[VisualEmbeddings] | None:
        done = self.engine.submit(
            ctx.key,
            items,
            tenant=ctx.tenant,
            processor_options=self.options,
            deadline=ctx.monotonic_deadline(),
            batch=ctx.batch,
        )
        self._load()
        return done

    async def stats(self) -> dict[str, int]:
        """Work counters (batches and items through the vision tower) and what the budget holds."""
        gate = self.admission.gate
        return {"batches": self.engine.batches, "items": self.engine.items_encoded, "admitted_patches": gate.used}

    def _load(self) -> None:
        self.metrics.load(len(self.runner.waiting), self.engine.batcher.pending_patches)

    def check_health(self) -> None:
        """Serve's health check: unhealthy once the vision tower failed steps in a row (:func:`check_engines`)."""
        check_engines("encode", [self.runner.driver.failures])

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(self.engine.batcher.pending_patches),
            "pending_items": float(len(self.runner.waiting)),
        }
