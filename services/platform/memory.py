"""How a replica's heap gives memory back to the system: keep what the stage's work frees for its next request, and
give it all back after a refused oversized body.

Keep (:func:`keep_freed_heap`, at a stage replica's start). glibc hands large freed blocks straight back to the kernel
— a block over its mmap threshold (128 KiB at first, raised as such blocks are freed) is unmapped, and free memory at
the top of a heap over its trim threshold is returned — so a stage whose every request allocates and frees the same
tens of MB of activations pays their page faults again on every request: the kernel zeroes each page anew. Measured
on a 2-core AMD EPYC (Zen 2), ``E/P/D`` with the bench's model, 20 one-small-image and 20 text requests one after
another, two runs each way, alternating: the encode replica took 56–88 k minor faults, the prefill 66–77 k; keeping
256 MiB (the default of both stages), 3.5–6.3 k and 31–32 k; the vision tower's span 44.6–45.9 → 41.0–42.0 ms, the
image request's TTFT p50 314–318 → 312–314 ms; resident memory +9 MB (encode) and +12–22 MB (prefill). The monolith,
all stages in one long-lived process, took 35–40 k faults for all of it. The price: a replica's resident memory
stays at its peak heap use instead of dropping back between requests (a replica must be sized for its peak anyway).
Settings are process-wide; a replica that holds several stages keeps the largest.

Give back (:func:`release_freed_memory`). A body refused at the limit has passed through many short-lived buffers
(ASGI messages, their pickles between the proxy and the ingress); once freed, glibc keeps most of that memory in its
heap for reuse, so the process's RSS stays tens of MB higher after every such request. ``malloc_trim(0)`` returns
the free heap tops and pages to the kernel, whatever is kept above; it takes milliseconds and runs only after a
refusal, never on the normal path. A no-op where libc has no ``malloc_trim`` (non-glibc systems).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_trim = _mallopt = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _mallopt = _libc.mallopt
    _mallopt.argtypes, _mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
except (OSError, AttributeError):
    pass

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
MMAP_THRESHOLD_MAX = 32 << 20
"""The largest mmap threshold glibc accepts on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): larger blocks are always
mapped apart, and unmapped when freed."""
_kept = 0


def keep_freed_heap(nbytes: int) -> bool:
    """Keep up to ``nbytes`` of freed memory at the top of each of this process's heaps, and serve blocks up to
    ``min(nbytes, 32 MiB)`` from them (see the module docstring); 0, or less than a setting already made in this
    process, changes nothing. Whether the settings now hold (``False`` where libc has no ``mallopt``)."""
    global _kept
    if nbytes <= _kept:
        return _kept > 0
    if _mallopt is None or not _mallopt(M_MMAP_THRESHOLD, min(nbytes, MMAP_THRESHOLD_MAX)):
        return False
    if not _mallopt(M_TRIM_THRESHOLD, min(nbytes, 2**31 - 1)):
        return False
    _kept = nbytes
    return True


def release_freed_memory() -> None:
    if _trim is not None:
        _trim(0)
