"""Where a hand-off's KV lands in a decode pool: the blocks a sequence was given, as segments of the pool's memory.

A hand-off's keys (and values) are ``[layers, n, block_size, kv_heads, head_dim]`` — the pool's own layout
(:mod:`common.kv.blocks`) — and its ``n`` blocks go to the pool blocks the sequence's lease allocated: one contiguous
run when the pool had one (the usual case: :meth:`common.kv.pool.KVPool.allocate_run`), several otherwise. For each
array, each layer and each run, the bytes to move are one contiguous piece on both sides:

* source: byte offset ``(layer · n + run.start) · block_bytes`` of the hand-off's array, ``run.count · block_bytes``
  long;
* destination: the pool array's ``[layer, run.block : run.block + run.count]``.

:meth:`Landing.pairs` yields them in the hand-off's byte order (keys, layer by layer, runs in sequence order; then
values), so a digest over the destinations in that order is the digest of the hand-off
(:func:`common.kv.digest.digest`): the receiver checks what landed, not what it was sent. A transport lands a
hand-off by copying these pairs (:func:`common.kv.digest.copy_digest`: the object store, the fake) or by one transfer
over their descriptors (NIXL: :meth:`Landing.remote_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from common.protocol.handoff import KVLayout


@dataclass(frozen=True)
class Run:
    start: int
    """Position of the run's first block in the hand-off."""
    block: int
    """The pool block it lands in."""
    count: int


def runs(blocks: Sequence[int]) -> tuple[Run, ...]:
    """Consecutive pool block ids grouped into runs, in sequence order."""
    out: list[Run] = []
    for i, b in enumerate(blocks):
        if out and out[-1].block + out[-1].count == b:
            last = out[-1]
            out[-1] = Run(last.start, last.block, last.count + 1)
        else:
            out.append(Run(i, int(b), 1))
    return tuple(out)


@dataclass(frozen=True)
class Landing:
    """A hand-off of ``layout`` landing in pool arrays ``keys`` / ``values`` (numpy views of the pool) at ``runs``."""

    layout: KVLayout
    keys: np.ndarray
    values: np.ndarray
    runs: tuple[Run, ...]

    @classmethod
    def of(cls, layout: KVLayout, pool_arrays: tuple[np.ndarray, np.ndarray], blocks: Sequence[int]) -> Landing:
        if len(blocks) != layout.num_blocks:
            raise ValueError(f"{len(blocks)} pool blocks for a hand-off of {layout.num_blocks}")
        # (checked here, where the bytes are counted: a transfer's descriptors are built from both sides' lengths, and
        # a slice past the pool's end would silently be shorter than its source)
        keys, values = pool_arrays
        pool_blocks, geometry = keys.shape[1], (keys.shape[0], *keys.shape[2:])
        if geometry != (layout.shape[0], *layout.shape[2:]) or keys.dtype != np.dtype(layout.numpy_dtype):
            raise ValueError(
                f"a hand-off of {layout.shape} {layout.numpy_dtype} into a pool of {keys.shape} {keys.dtype}"
            )
        if blocks and not 0 <= min(blocks) <= max(blocks) < pool_blocks:
            raise ValueError(f"pool blocks {min(blocks)}..{max(blocks)} outside a pool of {pool_blocks}")
        return cls(layout, keys, values, runs(blocks))

    def destinations(self) -> Iterator[np.ndarray]:
        """The pool's pieces, in the hand-off's byte order."""
        for pool in (self.keys, self.values):
            for layer in range(self.layout.shape[0]):
                for run in self.runs:
                    yield pool[layer, run.block : run.block + run.count]

    def pairs(self, src_keys: np.ndarray, src_values: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(pool piece, hand-off piece)`` in the hand-off's byte order (source arrays in the hand-off layout)."""
        dst = self.destinations()
        for src in (src_keys, src_values):
            for layer in range(self.layout.shape[0]):
                for run in self.runs:
                    yield next(dst), src[layer, run.start : run.start + run.count]

    def remote_pieces(self) -> Iterator[tuple[int, int, int]]:
        """``(array index 0 keys | 1 values, byte offset in the sender's array, length)`` of each piece, in the
        order of :meth:`destinations`."""
        n, block_bytes = self.layout.num_blocks, self.layout.block_bytes
        for array in (0, 1):
            for layer in range(self.layout.shape[0]):
                for run in self.runs:
                    yield array, (layer * n + run.start) * block_bytes, run.count * block_bytes
