"""Hand-off checksums at memory speed: XXH3-64 over a payload's bytes, and a copy that checksums what it wrote.

A hand-off's checksum (:func:`common.kv.blocks.seal`) is the XXH3-64 digest of its arrays' bytes, in order, as one
stream: the same digest whether the bytes sit in one array or in many segments (a sequence's KV as one export, or as
runs of blocks in a decode pool), so the receiver checks what *landed* against what was sent. XXH3 (the ``xxhash``
package, vectorised) hashes ≈ 2× faster than a memcpy copies here, where ``zlib.crc32`` ran at a quarter of a copy.

:func:`copy_digest` copies segment by segment in chunks small enough to stay in cache and hashes each chunk of the
*destination* right after writing it: the check costs a pass over cached bytes, not another trip to memory, and it
covers the copy itself (a bad write shows).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

CHUNK_BYTES = 256 << 10
"""Copy-and-hash granularity: small enough to stay in a core's L2 (copy + hash of 256 MB ran at 13.5 GB/s here with
256 KiB chunks, 10.5 with 1 MiB, against a 13 GB/s memcpy), large enough that the loop's own cost is noise."""


def flat_bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat ``uint8`` view (no copy); ``ValueError`` for anything strided."""
    if not a.flags.c_contiguous:
        raise ValueError("hand-off segments must be C-contiguous")
    return a.reshape(-1).view(np.uint8)


def digest(arrays: Iterable[np.ndarray]) -> int:
    """XXH3-64 of the arrays' bytes, one after another."""
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(flat_bytes(a))
    return h.intdigest()


def copy_digest(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
    """Copy each ``(destination, source)`` pair (same byte size, both C-contiguous) and return the XXH3-64 of the
    destinations' bytes, in order — what :func:`digest` of the sources is when the copy is good."""
    h = xxhash.xxh3_64()
    for dst, src in pairs:
        d, s = flat_bytes(dst), flat_bytes(src)
        if d.size != s.size:
            raise ValueError(f"copy of {s.size} bytes into {d.size}")
        for i in range(0, d.size, CHUNK_BYTES):
            piece = d[i : i + CHUNK_BYTES]
            np.copyto(piece, s[i : i + CHUNK_BYTES])
            h.update(piece)
    return h.intdigest()
