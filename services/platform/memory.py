"""Give freed heap memory back to the system after a refused oversized body.

A body refused at the limit has passed through many short-lived buffers (ASGI messages, their pickles between the
proxy and the ingress); once freed, glibc keeps most of that memory in its heap for reuse, so the process's RSS stays
tens of MB higher after every such request. ``malloc_trim(0)`` returns the free heap tops and pages to the kernel; it
takes milliseconds and runs only after a refusal, never on the normal path. A no-op where libc has no
``malloc_trim`` (non-glibc systems).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_trim = None
try:
    _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):
    _trim = None


def release_freed_memory() -> None:
    if _trim is not None:
        _trim(0)
