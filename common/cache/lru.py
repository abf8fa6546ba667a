"""A thread-safe LRU bounded by the **bytes** of its values, not their count.

One 16 MP image's pixel array outweighs a thousand thumbnails; a count-bounded cache would either waste memory or
thrash. Values larger than the whole budget are never stored. Counters (hits, misses, evictions, bytes) feed the
metrics.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    bytes: int = 0
    entries: int = 0


class ByteLRU(Generic[V]):
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be ≥ 0")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> bool:
        """Store ``value``; evict least-recently-used entries to fit. False if it can never fit."""
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._stats.bytes -= old[1]
            while self._items and self._stats.bytes + nbytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._stats.bytes -= size
                self._stats.evictions += 1
            self._items[key] = (value, nbytes)
            self._stats.bytes += nbytes
            self._stats.inserts += 1
            return True

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**{**self._stats.__dict__, "entries": len(self._items)})

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held — a look that counts as neither hit nor miss and does not refresh it."""
        with self._lock:
            return key in self._items
