"""Media deployment (CPU): fetch, check, decode and process a request's images and videos → ``ProcessedMedia``.

Thin wrapper: :class:`common.media.stage.MediaStage` does the safe fetch and decoding, the family processor and the
processor cache run in :func:`common.stages.process.process_images`. Work runs in a thread so one slow download never
blocks the replica's other requests. Loads the model's front end only (no weights).
"""

from __future__ import annotations

import asyncio
from typing import Any

from common.cache.processor_cache import ProcessorCache
from common.config import PrismConfig
from common.errors import InvalidRequestError
from common.media.loader import MediaRef
from common.media.stage import MediaStage
from common.model.loader import load_frontend
from common.protocol.handoff import ProcessedMedia
from common.stages.process import process_loaded
from services.runtime import check_deadline, set_threads


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

    async def process(self, refs: list[MediaRef], tenant: str, deadline: float) -> list[ProcessedMedia]:
        check_deadline(deadline, "media")
        self.in_flight += 1
        try:
            return await asyncio.to_thread(self._process, refs, tenant)
        finally:
            self.in_flight -= 1

    def _process(self, refs: list[MediaRef], tenant: str) -> list[ProcessedMedia]:
        unsupported = {r.kind for r in refs} - set(self.frontend.adapter.modalities)
        if unsupported:  # refuse before fetching anything
            raise InvalidRequestError(
                f"model {self.frontend.served_name} does not accept {', '.join(sorted(unsupported))} input",
                param="messages",
            )
        loaded = self.stage.load(refs)
        return process_loaded(
            self.frontend, loaded, cache=self.cache, tenant=tenant, options=self.stage.decode_options()
        )

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.in_flight)}
