"""Media deployment (CPU): fetch, check, decode and process a request's images and videos → ``ProcessedMedia``.

Thin wrapper: :class:`common.media.stage.MediaStage` does the safe fetch and decoding, the family processor and the
processor cache run in :func:`common.stages.process.process_images`. Work runs in a thread so one slow download never
blocks the replica's other requests. Loads the model's front end only (no weights).

Trace: ``media.queue`` (ingress sent → this call starts), ``media.fetch`` and ``media.decode`` (summed over items),
``media.process`` (the processor, with this request's processor-cache hits, pixels, frames and visual tokens).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.cache.processor_cache import ProcessorCache
from common.cache.tally import TalliedCache
from common.config import PrismConfig
from common.errors import InvalidRequestError
from common.media.loader import LoadTimings, MediaRef
from common.media.stage import MediaStage
from common.model.loader import load_frontend
from common.obs.keyed_hash import keyed_hash
from common.obs.trace import Timeline, Traced
from common.protocol.handoff import ProcessedMedia, RequestContext
from common.stages.process import process_loaded
from services.metrics import Metrics
from services.runtime import set_threads


class MediaDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = PrismConfig.model_validate(config)
        set_threads(self.cfg.model.torch_threads)
        self.frontend = load_frontend(self.cfg.model)
        self.stage = MediaStage(self.cfg.media)
        eng = self.cfg.engine
        self.cache = None
        if eng.processor_cache_bytes:
            self.cache = ProcessorCache(eng.processor_cache_bytes, eng.shared_cache_scope)
        self.in_flight = 0
        self.metrics = Metrics("media")
        self.metrics.keep_fresh(self._load)

    async def process(self, refs: list[MediaRef], ctx: RequestContext) -> Traced[list[ProcessedMedia]]:
        timeline = Timeline(ctx.sent_at)
        queued = timeline.mark("media.queue").duration_s
        ctx.check_deadline("media")
        self.in_flight += 1
        self._load()
        try:
            return await asyncio.to_thread(self._process, refs, ctx.tenant, timeline, queued)
        finally:
            self.in_flight -= 1
            self._load()

    def _process(
        self, refs: list[MediaRef], tenant: str, timeline: Timeline, queued: float
    ) -> Traced[list[ProcessedMedia]]:
        unsupported = {r.kind for r in refs} - set(self.frontend.adapter.modalities)
        if unsupported:  # refuse before fetching anything
            raise InvalidRequestError(
                f"model {self.frontend.served_name} does not accept {', '.join(sorted(unsupported))} input",
                param="messages",
            )
        start = time.time()
        timings = LoadTimings()
        loaded = self.stage.load(refs, timings)
        timeline.span("media.fetch", timings.fetch_s, items=len(refs), bytes=timings.nbytes)
        timeline.span("media.decode", timings.decode_s, frames=sum(len(m.frames) for m in loaded))
        view = TalliedCache(self.cache) if self.cache is not None else None
        out = process_loaded(self.frontend, loaded, cache=view, tenant=tenant, options=self.stage.decode_options())
        timeline.mark(
            "media.process",
            pixels=sum(m.source_size[0] * m.source_size[1] for m in out),
            visual_tokens=sum(m.num_visual_tokens for m in out),
            processor_cache_hits=view.hits if view else 0,
            processor_cache_misses=view.misses if view else 0,
            media=[keyed_hash(self.cfg.observability.media_hash_key, m.media_digest) for m in out],
        )
        self.metrics.stage_time(queued, time.time() - start)
        if view is not None and self.cache is not None:
            self.metrics.cache_lookups("processor", view.hits, view.misses)
            self.metrics.cache_bytes("processor", self.cache.stats().bytes)
        return timeline.wrap(out)

    def _load(self) -> None:
        self.metrics.load(self.in_flight, self.in_flight)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.in_flight)}
