"""Processor cache: decoded media digest + everything that shapes the processor's output → pixel arrays.

The key is the content digest of the fetched bytes (never the URL: the same URL may serve new bytes, two URLs may
serve the same bytes), the processor class and revision from the model contract, every decode/processor option
(canonical JSON) and the dtype — and the tenant, unless the operator marks the cache shared. A hit returns the exact
arrays a recompute would produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.cache.lru import ByteLRU, CacheStats
from common.cache.scope import cache_scope
from common.model.families.base import ProcessedPixels


@dataclass(frozen=True)
class ProcessorCacheKey:
    scope: str
    media_digest: str
    processor_class: str
    processor_revision: str
    options: str
    dtype: str


def canonical_options(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, separators=(",", ":"), default=str)


class ProcessorCache:
    def __init__(self, max_bytes: int, shared_across_tenants: bool = False) -> None:
        self._lru: ByteLRU[ProcessedPixels] = ByteLRU(max_bytes)
        self.shared = shared_across_tenants

    def key(
        self,
        tenant: str,
        media_digest: str,
        processor_class: str,
        processor_revision: str,
        options: dict[str, Any],
        dtype: str,
    ) -> ProcessorCacheKey:
        return ProcessorCacheKey(
            scope=cache_scope(tenant, self.shared),
            media_digest=media_digest,
            processor_class=processor_class,
            processor_revision=processor_revision,
            options=canonical_options(options),
            dtype=dtype,
        )

    def get(self, key: ProcessorCacheKey) -> ProcessedPixels | None:
        return self._lru.get(key)

    def put(self, key: ProcessorCacheKey, value: ProcessedPixels) -> bool:
        # Hits share the array with every later request: make accidental in-place edits fail loudly.
        value.pixel_values.flags.writeable = False
        return self._lru.put(key, value, int(value.pixel_values.nbytes))

    def stats(self) -> CacheStats:
        return self._lru.stats()
