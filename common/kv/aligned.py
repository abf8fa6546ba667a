"""Page-aligned memory for everything a hand-off moves between: the senders' staging and landing arenas and the KV
pools the bytes land in.

A hand-off copies from one of these regions into another — UCX's cross-memory attach (a kernel copy between two
processes), or a copy in process. Such a copy runs at full speed only where source and destination sit at the same
offset within a 64-byte line: a 256 MB NIXL READ from a staging arena into a KV pool took 33 ms where the two were
48 bytes apart (the pool from torch's allocator, 64 bytes into a page; the arena from numpy's, 16) and 21–23 ms
where they were not (AMD EPYC, Zen 4, 2026-12-04; the same gap for a destination at 0 or 64 bytes into a page against a
source at 16). Allocators place large buffers 16 or 64 bytes into a page, each its own way, so every such region is
allocated here instead: the start on a page (:data:`PAGE`), so that any two offsets that are multiples of 64 in two
regions — a slot of an arena, a block of a pool — line up.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PAGE = 4096


def zeros(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes (``uint8``) starting on a page. Its pages arrive on first use, as numpy's zeros do."""
    raw = np.zeros(nbytes + PAGE, np.uint8)
    start = -int(raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]  # (the view keeps ``raw`` alive)


def tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of ``shape`` and ``dtype`` starting on a page, its pages touched now (a pool's memory is
    committed when the pool is made, as ``torch.zeros`` commits it)."""
    buf = zeros(math.prod(shape) * dtype.itemsize)
    buf.fill(0)
    return torch.from_numpy(buf).view(dtype).view(shape)
