"""Hand-off checksums at memory speed: a segmented XXH3-64 over a payload's bytes, and a copy that checksums what it
wrote, spread over the cores.

A hand-off's checksum (:func:`common.kv.blocks.seal`) covers its arrays' bytes, in order, as one stream, cut into
segments of :data:`SEGMENT_BYTES` at fixed offsets of that stream: the checksum is the XXH3-64 of the segments' own
XXH3-64 digests (little-endian ``uint64``, in order). It is the same whether the bytes sit in one array or in many
pieces (a sequence's KV as one export, or as runs of blocks in a decode pool), so the receiver checks what *landed*
against what was sent; and since each segment is hashed on its own, several threads can each take whole segments
(a single XXH3 stream could only be fed by one). XXH3 (the ``xxhash`` package's C code, vectorised, called without
the GIL: :mod:`common.kv.xxh3`) hashes faster than a memcpy copies; a one-thread copy with ordinary stores is the
slow part (≈ 6.6 GB/s on a Xeon where one large memcpy reaches 12).

:func:`copy_digest` copies in chunks small enough to stay in a core's cache and hashes each chunk of the
*destination* right after writing it (:meth:`common.kv.xxh3.Stream.copy_update`, outside the GIL): the check costs a
pass over cached bytes, not another trip to memory, and it covers the copy itself (a bad write shows). A payload of
several segments is shared between the calling thread and the module's landing threads (:data:`THREADS` in all),
each taking the next segment not yet taken; the call returns once every segment is done (no thread of ours touches
the destination after that) and raises what any of them raised.
A caller at a lowered priority (throughput work) does its segments alone.
:class:`SegmentedDigest` is the same checksum fed in order, one piece at a time (the export); a NIXL landing's is
:class:`common.kv.hash_behind.HashBehind`.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from common.kv import xxh3

CHUNK_BYTES = 256 << 10
"""Copy-and-hash granularity: small enough to stay in a core's L2 (copy + hash of 256 MB ran at 13.5 GB/s here with
256 KiB chunks, 10.5 with 1 MiB, against a 13 GB/s memcpy), large enough that the loop's own cost is noise."""
SEGMENT_BYTES = 4 << 20
"""The unit one thread copies and hashes: 64 of them in a 256 MB KV, so two to four threads share it evenly; a KV of
one segment (≈ 4 MB) is not worth a second thread."""
SCHEME = "xxh3-64/seg-4MiB"
"""What the checksum is. A seal names it, and a receiver refuses a hand-off sealed under another as one from another
revision of Prism (retried on one revision, like a model revision mismatch), never as corrupted bytes: during a
rolling update across a change of the checksum, both sides' code must agree."""
THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Threads a copy or a digest may use at once, the caller's included: the usable cores, at most 4 (memory bandwidth,
not cores, bounds a copy past that)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def flat_bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat ``uint8`` view (no copy); ``ValueError`` for anything strided."""
    if not a.flags.c_contiguous:
        raise ValueError("hand-off segments must be C-contiguous")
    return a.reshape(-1).view(np.uint8)


def combine(digests: list[int]) -> int:
    """The checksum of a stream from its segments' XXH3-64 digests, in order."""
    return xxhash.xxh3_64_intdigest(np.array(digests, dtype="<u8").tobytes())


class SegmentedDigest:
    """The hand-off checksum of a stream fed in order (``update`` with any piece sizes)."""

    def __init__(self) -> None:
        self._done: list[int] = []
        self._h = xxh3.Stream()
        self._fill = 0

    def update(self, data: np.ndarray) -> None:
        data = flat_bytes(data)
        at = 0
        while at < data.size:
            take = min(data.size - at, SEGMENT_BYTES - self._fill)
            self._h.update(data[at : at + take])
            self._fill, at = self._fill + take, at + take
            if self._fill == SEGMENT_BYTES:
                self._done.append(self._h.intdigest())
                self._h.reset()
                self._fill = 0

    def intdigest(self) -> int:
        tail = [self._h.intdigest()] if self._fill or not self._done else []
        return combine(self._done + tail)


def cut_segments(pairs: list[tuple[np.ndarray, np.ndarray | None]]) -> list[list[tuple[np.ndarray, np.ndarray | None]]]:
    """The stream of ``pairs`` (flat ``uint8`` destinations, each with its source or ``None``) cut at every
    :data:`SEGMENT_BYTES`: per segment, its pieces."""
    out: list[list[tuple[np.ndarray, np.ndarray | None]]] = [[]]
    fill = 0
    for dst, src in pairs:
        at = 0
        while at < dst.size:
            if fill == SEGMENT_BYTES:
                out.append([])
                fill = 0
            take = min(dst.size - at, SEGMENT_BYTES - fill)
            out[-1].append((dst[at : at + take], None if src is None else src[at : at + take]))
            fill, at = fill + take, at + take
    return out


def _do_segment(pieces: list[tuple[np.ndarray, np.ndarray | None]]) -> int:
    h = xxh3.Stream()
    for dst, src in pieces:
        if src is None:
            h.update(dst)  # (a hash alone reads at memory speed: no chunks to keep in cache)
        else:
            h.copy_update(dst, src, CHUNK_BYTES)
    return h.intdigest()


def _landing_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, THREADS - 1), thread_name_prefix="prism-land")
        return _pool


def _at_full_priority() -> bool:
    """Whether the calling thread runs at its process's priority: no niceness above the main thread's, the ordinary
    policy. Only such a caller shares its work: a new pool thread inherits its creator's niceness and policy (Linux:
    both are per thread), and throughput work at a lowered priority (``services.stages.threads``) must neither make
    the landing threads low-priority nor spread itself over more cores."""
    if not hasattr(os, "sched_getscheduler"):
        return True
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # (the main thread's: Ray starts its workers at 15, Prism at 0)
    return os.getpriority(os.PRIO_PROCESS, tid) <= base and os.sched_getscheduler(tid) == os.SCHED_OTHER


def _run(pairs: list[tuple[np.ndarray, np.ndarray | None]], threads: int) -> int:
    segments = cut_segments(pairs)
    digests = [0] * len(segments)
    helpers = min(threads, len(segments)) - 1
    if helpers <= 0 or not _at_full_priority():  # (the priority's syscalls only when there is work to share)
        return combine([_do_segment(s) for s in segments])
    claims, lock, errors = itertools.count(), threading.Condition(), []
    busy = [0, 0]  # segments being worked on, segments finished or abandoned

    def work() -> None:
        while True:
            with lock:
                i = next(claims)
                if i >= len(segments) or errors:
                    return
                busy[0] += 1
            try:
                digests[i] = _do_segment(segments[i])
            except BaseException as exc:  # (reported by the caller; the others stop taking segments)
                with lock:
                    errors.append(exc)
            finally:
                with lock:
                    busy[0] -= 1
                    busy[1] += 1
                    lock.notify_all()

    try:
        pool = _landing_pool()
        for _ in range(helpers):  # (a helper that starts after the caller took every segment finds none and returns)
            pool.submit(work)
    except RuntimeError:  # no thread to be had (a thread limit, interpreter shutdown): the caller does the rest
        pass
    work()
    with lock:  # every segment taken is done before we return: no thread of ours writes the destination after this
        lock.wait_for(lambda: busy[0] == 0 and (errors or busy[1] == len(segments)))
    if errors:
        raise errors[0]
    return combine(digests)


def digest(arrays: Iterable[np.ndarray], threads: int = THREADS) -> int:
    """The hand-off checksum of the arrays' bytes, one after another."""
    return _run([(flat_bytes(a), None) for a in arrays], threads)


def copy_digest(pairs: Iterable[tuple[np.ndarray, np.ndarray]], threads: int = THREADS) -> int:
    """Copy each ``(destination, source)`` pair (same byte size, both C-contiguous) and return the checksum of the
    destinations' bytes, in order — what :func:`digest` of the sources is when the copy is good."""
    flat: list[tuple[np.ndarray, np.ndarray | None]] = []
    for dst, src in pairs:
        d, s = flat_bytes(dst), flat_bytes(src)
        if d.size != s.size:
            raise ValueError(f"copy of {s.size} bytes into {d.size}")
        flat.append((d, s))
    return _run(flat, threads)
