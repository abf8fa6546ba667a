"""A landing's checksum hashed behind the transfer that moves it: each piece hashed as soon as it has landed, while it
is still in cache, on a thread that does not wait for the GIL.

Lifecycle, for one landing (:meth:`common.kv.transport.nixl.NixlTransport.land`): :class:`HashBehind` is made with
the landing's destination pieces, in stream order, before the first transfer is posted — it cuts them at the
checksum's segment boundaries (the digest's own cut, :func:`common.kv.digest.cut_segments`) and starts the hash on
the given executor; the transferring thread calls :meth:`HashBehind.landed` as each transfer completes;
:meth:`HashBehind.intdigest` waits for the last piece and gives the checksum, the same as
:func:`common.kv.digest.digest` of the pieces (a loop still queued behind other landings' is run by the caller then,
so one slow transfer never holds up another's check). :meth:`HashBehind.abort` (the transfer failed) stops the hash
and returns only once nothing of it reads the destination any more.

Why a C loop (``native/hash_behind.c``): NIXL's ``transfer()`` holds the GIL while UCX's cross-memory attach copies
inside it, so a Python thread that hashed each group and went back to Python for the next waited for the GIL behind
every post — the hash ran after the copy more than beside it, and read the bytes back from memory. The C loop is one
foreign call for the whole landing (``ctypes`` releases the GIL for it): it waits for each piece with short naps and
hashes it with the xxhash package's own C functions. Where it cannot be built (no compiler, another build of the
package) the pieces are hashed once every one has landed (:func:`common.kv.digest.digest`, shared between the cores):
the same checksum, no overlap.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import HandoffError
from common.kv import xxh3
from common.kv.digest import combine, cut_segments, digest, flat_bytes
from common.native_build import load_optional

SOURCE = Path(__file__).with_name("native") / "hash_behind.c"
assert ctypes.sizeof(ctypes.c_size_t) == np.dtype(np.uintp).itemsize  # (the loop takes the counts as size_t)
ABORTED = np.iinfo(np.uintp).max
"""Published in place of a count: the landing failed, the loop returns without hashing the rest."""


@functools.cache
def _library() -> Any | None:
    if xxh3.functions() is None:
        return None
    built = load_optional(
        SOURCE, "PRISM_HASH_BEHIND", "the landing's C hash loop", "landings are hashed once they have landed"
    )
    if built is None:
        return None
    lib = built[0]
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.hash_behind.restype = ctypes.c_long
    lib.hash_behind.argtypes = [ptr, ptr, ptr, size, ptr, ctypes.c_int64, ptr, ptr, ptr, ptr, ptr]
    lib.hash_behind_publish.restype = None
    lib.hash_behind_publish.argtypes = [ptr, size]
    return lib


def warm() -> bool:
    """Build (or load) the C loop now — a replica's start, not its first hand-off; whether it is there."""
    return _library() is not None


def _cut(pieces: list[np.ndarray]) -> tuple[list[tuple[int, int, bool]], list[int]]:
    """The pieces cut at every segment boundary of their stream (:func:`common.kv.digest.cut_segments`): ``(address,
    length, ends a segment)`` in order, and for each piece how many cut pieces there are up to its end."""
    cut: list[tuple[int, int, bool]] = []
    for segment in cut_segments([(p, None) for p in pieces]):
        cut += [(int(v.ctypes.data), int(v.size), j == len(segment) - 1) for j, (v, _) in enumerate(segment)]
    ends = list(itertools.accumulate(n for _, n, _ in cut))
    return cut, [bisect.bisect_right(ends, end) for end in itertools.accumulate(int(p.size) for p in pieces)]


class HashBehind:
    """The hand-off checksum of ``pieces`` (C-contiguous arrays, in stream order), hashed on ``executor`` as they
    are published landed; a loop left waiting longer than ``timeout_s`` for its next piece gives up (the landing's
    own deadline has passed by then: its transfer failed, and the checksum is refused)."""

    def __init__(self, pieces: list[np.ndarray], executor: Executor, timeout_s: float = 60.0) -> None:
        self._pieces = [flat_bytes(p) for p in pieces]  # (held: the loop reads their memory by address)
        self._published = 0
        self._result: int | None = None
        self._lib = _library() if sum(p.size for p in self._pieces) else None
        if self._lib is None:  # (no loop, or nothing to hash: hashed whole once landed)
            return
        cut, self._upto = _cut(self._pieces)
        self._addrs = np.array([a for a, _, _ in cut], np.uintp)
        self._lens = np.array([n for _, n, _ in cut], np.uintp)
        self._ends = np.array([e for _, _, e in cut], np.uint8)
        self._digests = np.zeros(int(self._ends.sum()), np.uint64)
        self._ready = np.zeros(1, np.uintp)
        self._timeout_ns = int(timeout_s * 1e9)
        self._stream = xxh3.Stream()  # (its state, fed by the loop; freed with this object)
        self._loop: Future = executor.submit(self._run)  # (the work item holds this object while the loop runs)

    def _run(self) -> int:
        update, reset, digest = xxh3.functions()  # type: ignore[misc]
        return self._lib.hash_behind(  # type: ignore[union-attr]
            self._addrs.ctypes.data,
            self._lens.ctypes.data,
            self._ends.ctypes.data,
            self._addrs.size,
            self._ready.ctypes.data,
            self._timeout_ns,
            self._stream.address,
            update,
            reset,
            digest,
            self._digests.ctypes.data,
        )

    def landed(self, upto: int) -> None:
        """``pieces[:upto]`` have landed: hash them."""
        if upto <= self._published:
            return
        if self._lib is not None:
            self._lib.hash_behind_publish(self._ready.ctypes.data, self._upto[upto - 1])
        self._published = upto

    def abort(self) -> None:
        """Stop hashing; returns once nothing of it reads the pieces."""
        if self._lib is None:
            return
        self._lib.hash_behind_publish(self._ready.ctypes.data, int(ABORTED))
        if not self._loop.cancel():  # (started: it returns at the next piece it would wait for)
            self._loop.exception()

    def intdigest(self) -> int:
        """The checksum of every piece (all of them published landed); the same on every call."""
        if self._result is not None:
            return self._result
        if self._published < len(self._pieces):  # (a caller's bug: the loop must not wait on for the rest)
            self.abort()
            raise RuntimeError(f"checksum asked with {self._published} of {len(self._pieces)} pieces landed")
        if self._lib is None:  # (the fallback: every landed piece at once, shared between the cores)
            self._result = digest(self._pieces)
            return self._result
        # A loop still queued (the executor's threads busy with other landings, one of them perhaps waiting on a slow
        # sender) is run here instead, every piece landed: a landing never waits on another's transfer.
        written = self._run() if self._loop.cancel() else self._loop.result()
        if written != self._digests.size:
            raise HandoffError(f"the landing's hash loop stopped before its last piece ({written})")
        self._result = combine(self._digests.tolist())
        return self._result
