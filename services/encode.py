"""Encode deployment: vision tower + projector behind the encoder cache and the shape-bucketed batcher.

Requests from many callers share batches: each call submits its items to the :class:`EncodeEngine` and awaits a
future; the driver loop encodes one batch per step. A cancelled call (client gone) removes its queued items.
"""

from __future__ import annotations

import time
from typing import Any

from common.cache.encoder_cache import EncoderCache
from common.config import PrismConfig
from common.engine.encode import EncodeEngine
from common.media.stage import decode_options
from common.model.loader import load_model
from common.protocol.handoff import ProcessedMedia, VisualEmbeddings
from common.sched.encoder_batcher import EncoderBatcher
from services.runtime import AwaitedEngine, check_deadline


class EncodeDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = PrismConfig.model_validate(config)
        self.lm = load_model(self.cfg.model)
        eng = self.cfg.engine
        cache = None
        if eng.encoder_cache_bytes:
            cache = EncoderCache(eng.encoder_cache_bytes, eng.shared_cache_scope)
        batcher = EncoderBatcher(patch_budget=eng.encoder_patch_budget)
        self.engine = EncodeEngine(self.lm, batcher, cache, time.monotonic)
        self.options = decode_options(self.cfg.media)
        self.runner = AwaitedEngine(self.engine.step, self.engine.has_work, dict.items, self.engine.cancel)

    async def encode(
        self, media: list[ProcessedMedia], request_id: str, tenant: str, deadline: float
    ) -> list[VisualEmbeddings]:
        if not media:
            return []
        check_deadline(deadline, "encode")
        return await self.runner.run(
            request_id,
            lambda: self.engine.submit(request_id, media, tenant=tenant, processor_options=self.options),
        )

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            "queue_depth": float(self.engine.batcher.pending_patches),
            "pending_items": float(len(self.runner.waiting)),
        }
