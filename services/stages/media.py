"""Media deployment (CPU): fetch, check, decode and process a request's images and videos → ``ProcessedMedia``.

Thin wrapper: :class:`common.media.stage.MediaStage` does the safe fetch and decoding, the family processor and the
processor cache run in :func:`common.stages.process.process_images`. Work runs on two bounded thread pools of the
stage's own — downloads (``deployments.media.fetch_threads``) and decoding (``decode_threads``) — so one slow download
never blocks the replica's other requests, and a flood of them waits for a download thread, not for everything. Loads
the model's front end only (no weights).

Lifecycle of one call: fetch + sniff + header check (thread; nothing decoded) → **admission** against the replica's
pixel budget (``admission.media_pixel_budget``: waits its turn, tenants served fairly, or 429 / 504 —
:mod:`common.admission.stage`) →
decode + processor (thread, holding the pixels until it ends) → the request's :class:`ResourceVector` completed
from the processed media and checked against every per-request limit — visual tokens, the prompt limit, the decode
KV lease — so a request that cannot fit is refused here, before the encoder queue. Fetch and decode stop at the
request's deadline (``min(deadline, media timeouts)``) and when the caller goes away.

Trace: ``media.queue`` (ingress sent → this call starts), ``media.fetch`` (downloads and header checks),
``media.admission`` (waiting for room in the pixel budget), ``media.decode`` (summed over items), ``media.process``
(the processor, with this request's processor-cache hits, pixels, patches, visual and prompt tokens).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from common.admission.limits import check_limits
from common.admission.stage import budget_admission
from common.cache.processor_cache import ProcessorCache
from common.cache.tally import TalliedCache
from common.config import PrismConfig
from common.errors import InvalidRequestError
from common.media.loader import CheckedMedia, LoadTimings
from common.media.stage import MediaStage
from common.model.loader import load_frontend
from common.obs.keyed_hash import keyed_hash
from common.obs.trace import Timeline, Traced
from common.protocol.handoff import MediaRef, ProcessedMedia, RequestContext
from common.protocol.vector import ResourceVector
from common.stages.process import process_loaded
from common.stop import Stop
from services.platform.loopback import bind_replica
from services.platform.metrics import Metrics
from services.stages.threads import nice_process, nice_thread, set_threads


class MediaDeployment:
    def __init__(self, config: dict[str, Any], grouped: bool = False) -> None:
        """``grouped``: the stage shares its replica with others (``ME/…`` topologies, :mod:`services.stages.group`),
        whom its priority must not reach — only its own threads are niced, when they take up its work."""
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        set_threads(self.cfg.model.torch_threads)
        self.nice = self.cfg.deployments.media.cpu_nice
        if not grouped:
            nice_process(self.nice)
        self.frontend = load_frontend(self.cfg.model)
        self.stage = MediaStage(self.cfg.media)
        eng = self.cfg.engine
        self.cache = None
        if eng.processor_cache_bytes:
            self.cache = ProcessorCache(eng.processor_cache_bytes, eng.shared_cache_scope)
        self.in_flight = 0
        # Pools of the stage's own, bounded: downloads (I/O: a slow origin holds a thread, not the replica's other
        # work) and decoding (CPU, within the pixel budget) never queue behind each other or the loop's default pool.
        stage = self.cfg.deployments.media
        self.fetch_pool = ThreadPoolExecutor(stage.fetch_threads, "prism-media-fetch")
        self.decode_pool = ThreadPoolExecutor(stage.decode_threads, "prism-media-decode")
        self.metrics = Metrics("media")
        adm = self.cfg.admission
        self.admission = budget_admission("media", "pixels", adm.media_pixel_budget, adm, self.metrics)
        self.metrics.keep_fresh(self._load)

    async def process(self, refs: list[MediaRef], ctx: RequestContext) -> Traced[list[ProcessedMedia]]:
        timeline = Timeline(ctx.sent_at)
        queued = timeline.mark("media.queue").duration_s
        ctx.check_deadline("media")
        self._check_modalities(refs)  # refuse before fetching anything
        stop = Stop(ctx.monotonic_deadline())
        timings = LoadTimings()
        self.in_flight += 1
        self._load()
        try:
            start = time.time()
            try:
                loop = asyncio.get_running_loop()
                checked = await loop.run_in_executor(self.fetch_pool, self._fetch, refs, timings, stop)
            except asyncio.CancelledError:
                stop.cancel()  # the thread ends at its next check instead of finishing the download for nobody
                raise
            timeline.mark("media.fetch", items=len(checked), bytes=timings.nbytes)
            pixels = sum(c.pixels for c in checked)
            fetched = replace(self._ingress_vector(ctx, len(checked)), pixels=pixels, media_bytes=timings.nbytes)
            self._check(fetched)  # pixels from the headers: nothing decoded yet
            grant = await self.admission.admit(ctx, pixels, 0)  # media: first come, first served within a class
            timeline.mark("media.admission", pixels=pixels, waited=grant.waited_s > 0)
            work = lambda: self._decode(checked, ctx, timings, timeline, stop)  # noqa: E731
            out = await self.admission.in_thread(grant, stop, work, self.decode_pool)
            self.metrics.stage_time(queued, time.time() - start)
            return out
        finally:
            self.in_flight -= 1
            self._load()

    def _fetch(self, refs: list[MediaRef], timings: LoadTimings, stop: Stop) -> list[CheckedMedia]:
        nice_thread(self.nice)
        return self.stage.fetch(refs, timings, stop)

    def _check_modalities(self, refs: list[MediaRef]) -> None:
        unsupported = {r.kind for r in refs} - set(self.frontend.adapter.modalities)
        if unsupported:
            raise InvalidRequestError(
                f"model {self.frontend.served_name} does not accept {', '.join(sorted(unsupported))} input",
                param="messages",
            )

    def _decode(
        self, checked: list[CheckedMedia], ctx: RequestContext, timings: LoadTimings, timeline: Timeline, stop: Stop
    ) -> Traced[list[ProcessedMedia]]:
        nice_thread(self.nice)
        loaded = self.stage.decode(checked, timings, stop)
        timeline.span("media.decode", timings.decode_s, frames=sum(len(m.frames) for m in loaded))
        stop.check("media processing")
        view = TalliedCache(self.cache) if self.cache is not None else None
        out = process_loaded(self.frontend, loaded, cache=view, tenant=ctx.tenant, options=self.stage.decode_options())
        vector = self._check_vector(ctx, out, timings.nbytes)
        timeline.mark(
            "media.process",
            media_bytes=vector.media_bytes,
            pixels=vector.pixels,
            patches=vector.patches,
            visual_tokens=vector.visual_tokens,
            prompt_tokens=vector.prompt_tokens,
            processor_cache_hits=view.hits if view else 0,
            processor_cache_misses=view.misses if view else 0,
            media=[keyed_hash(self.cfg.observability.media_hash_key, m.media_digest) for m in out],
        )
        if view is not None and self.cache is not None:
            self.metrics.cache_lookups("processor", view.hits, view.misses)
            self.metrics.cache_bytes("processor", self.cache.stats().bytes)
        return timeline.wrap(out)

    def _check_vector(self, ctx: RequestContext, out: list[ProcessedMedia], nbytes: int) -> ResourceVector:
        """The request's vector completed by its processed media (and the bytes fetched), checked against every
        per-request limit: the prompt and the KV lease are judged here, before the encoder queue, not after encode
        or prefill ran."""
        vector = self._ingress_vector(ctx, len(out)).with_media(out, self.cfg.engine.kv_block_size, media_bytes=nbytes)
        self._check(vector)
        return vector

    def _ingress_vector(self, ctx: RequestContext, items: int) -> ResourceVector:
        """What the ingress knew (a bare lower bound when a caller sent no vector)."""
        return ctx.vector or ResourceVector.at_ingress(items, items, 0, self.cfg.engine.kv_block_size)

    def _check(self, vector: ResourceVector) -> None:
        eng = self.cfg.engine
        check_limits(vector, self.cfg.admission, eng.max_prompt_tokens, eng.max_lease_blocks)

    def _load(self) -> None:
        self.metrics.load(self.in_flight, self.in_flight)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.in_flight)}
