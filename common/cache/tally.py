"""A per-request view of a shared cache that counts this request's own hits and misses.

The shared cache's counters mix every concurrent request; a request's trace needs its own outcome ("was *my* image
a hit?"), so the stage hands the processing code this view instead of the cache itself.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class _Cache(Protocol[K, V]):
    def key(self, *args: Any, **kwargs: Any) -> K: ...
    def get(self, key: K) -> V | None: ...
    def put(self, key: K, value: V) -> bool: ...


class TalliedCache(Generic[K, V]):
    def __init__(self, cache: _Cache[K, V]) -> None:
        self.cache = cache
        self.hits = 0
        self.misses = 0

    def key(self, *args: Any, **kwargs: Any) -> K:
        return self.cache.key(*args, **kwargs)

    def get(self, key: K) -> V | None:
        value = self.cache.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: K, value: V) -> bool:
        return self.cache.put(key, value)
