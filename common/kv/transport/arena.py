"""A staging arena: one region allocated (and, by a transport, registered) once, carved into slots per hand-off.

A sender that must keep a hand-off's bytes in registered memory until the receiver has read them exports straight
into a slot of its arena instead of into fresh arrays: nothing is allocated or registered per hand-off. Slots are
first fit over the free ranges (kept sorted and merged on free), sizes rounded up to :data:`ALIGN` so that every slot
starts on a page. A full arena says so (``None``) and the caller falls back to fresh memory; it never waits.

Not thread-safe on its own: its owner (the transport) holds a lock around it.
"""

from __future__ import annotations

import bisect

import numpy as np

from common.kv import aligned

ALIGN = aligned.PAGE


class Arena:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self.buffer = aligned.zeros(self.nbytes)  # (its pages arrive on first use, once: slots are reused)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []  # (offset, size), by offset
        self._used: dict[int, int] = {}

    @property
    def address(self) -> int:
        return int(self.buffer.ctypes.data)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least ``nbytes`` (first fit), or ``None`` when none is free."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._used[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with the neighbours, right first (its index moves when the left one merges)
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            left = self._free.pop(i - 1)
            self._free[i - 1] = (left[0], left[1] + self._free[i - 1][1])

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` over the arena's bytes from ``offset``."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.buffer[offset : offset + nbytes].view(dtype).reshape(shape)

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array``'s data starts in the arena, if it lies in it."""
        offset = int(array.ctypes.data) - self.address
        return offset if 0 <= offset and offset + array.nbytes <= self.nbytes else None
