"""Prefix cache: chained block hash → a KV block held in the pool.

The cache owns one reference on every block it maps. A lookup walks a prompt's hash chain from the start and stops at
the first miss (a later hit is useless: its KV attended to the missed block). Inserting a block it already holds is
a no-op. Eviction is least-recently-used and only takes blocks nobody else references, so it never yanks KV out from
under a running sequence; the pool calls :meth:`reclaim` when a lease cannot be granted otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.kv.pool import KVPool


@dataclass
class PrefixStats:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: KVPool, max_blocks: int | None = None) -> None:
        self.pool = pool
        self.max_blocks = max_blocks if max_blocks is not None else pool.num_blocks
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self.stats = PrefixStats()
        pool.set_reclaimer(self.reclaim)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Pool blocks for the longest cached prefix of ``hashes``."""
        self.stats.lookups += 1
        found = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            self._blocks.move_to_end(h)
            found.append(block)
        self.stats.hit_blocks += len(found)
        self.stats.miss_blocks += len(hashes) - len(found)
        return found

    def insert(self, h: bytes, block: int) -> bool:
        """Map ``h`` to ``block`` (taking a reference); False if ``h`` is already cached."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return False
        if len(self._blocks) >= self.max_blocks and not self.reclaim(1):
            return False
        self.pool.ref([block])
        self._blocks[h] = block
        self.stats.inserted_blocks += 1
        return True

    def reclaim(self, n: int) -> int:
        """Evict up to ``n`` least-recently-used blocks that only the cache references; returns how many."""
        freed = 0
        for h in list(self._blocks):
            if freed >= n:
                break
            block = self._blocks[h]
            if self.pool.refcount(block) == 1:
                del self._blocks[h]
                self.pool.unref([block])
                freed += 1
        self.stats.evicted_blocks += freed
        return freed

    def clear(self) -> None:
        for block in self._blocks.values():
            self.pool.unref([block])
        self._blocks.clear()
