"""Encoder cache: media identity + processor key + encoder/projector revision + precision → visual embeddings.

Tenant-scoped unless the operator shares it. Eviction keeps what is expensive to recompute per byte held: the entry
with the lowest ``recompute_cost / bytes`` goes first (least recently used among equals), so one 4K image whose
encode took 300 ms is not pushed out by a burst of thumbnails that each cost 2 ms. A hit returns the very array the
first encode produced (read-only), so hit == recompute by construction; the tests also check it against a fresh
encode.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from common.cache.lru import CacheStats
from common.cache.scope import cache_scope


@dataclass(frozen=True)
class EncoderCacheKey:
    scope: str
    media_digest: str
    processor_key: str
    """Processor class + revision + options (see :mod:`common.cache.processor_cache`)."""
    encoder_key: str
    """``ModelContract.encoder_key``: vision tower + projector revisions + dtype."""


@dataclass
class _Entry:
    value: np.ndarray
    nbytes: int
    cost: float
    used: int


class EncoderCache:
    def __init__(self, max_bytes: int, shared_across_tenants: bool = False) -> None:
        self.max_bytes = max_bytes
        self.shared = shared_across_tenants
        self._entries: dict[EncoderCacheKey, _Entry] = {}
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def key(self, tenant: str, media_digest: str, processor_key: str, encoder_key: str) -> EncoderCacheKey:
        return EncoderCacheKey(cache_scope(tenant, self.shared), media_digest, processor_key, encoder_key)

    def get(self, key: EncoderCacheKey) -> np.ndarray | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            entry.used = next(self._clock)
            self._stats.hits += 1
            return entry.value

    def put(self, key: EncoderCacheKey, embeddings: np.ndarray, recompute_cost: float) -> bool:
        """Store embeddings that took ``recompute_cost`` (seconds, or any consistent unit) to compute."""
        nbytes = int(embeddings.nbytes)
        if nbytes > self.max_bytes:
            return False
        embeddings.flags.writeable = False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._stats.bytes -= old.nbytes
            while self._entries and self._stats.bytes + nbytes > self.max_bytes:
                victim = min(
                    self._entries,
                    key=lambda k: (self._entries[k].cost / self._entries[k].nbytes, self._entries[k].used),
                )
                self._stats.bytes -= self._entries.pop(victim).nbytes
                self._stats.evictions += 1
            self._entries[key] = _Entry(embeddings, nbytes, recompute_cost, next(self._clock))
            self._stats.bytes += nbytes
            self._stats.inserts += 1
            return True

    def __contains__(self, key: EncoderCacheKey) -> bool:
        return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**{**self._stats.__dict__, "entries": len(self._entries)})
