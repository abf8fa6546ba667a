"""XXH3-64 hashed without holding the GIL: the hand-off checksum's hash, free to run beside the thread that moves the
bytes.

The ``xxhash`` package holds the GIL while it hashes (two threads hashing 128 MB each took as long as one thread
hashing both, 8.7 against 8.9 ms, on a 2-core AMD EPYC Zen 4 with AVX-512), and so does NIXL's ``transfer()`` while
UCX's cross-memory attach copies a READ inside it: a NIXL landing that hashed each group on a second thread while the
next group moved ran the two one after the other (256 MB: 21 ms of READ, then about 9 of hashing). The package's
compiled module exports the xxHash library's own C functions, with its runtime dispatch to the widest SIMD the CPU
has; called through ``ctypes`` (which releases the GIL for the length of a foreign call) they hash the same bytes to
the same digest, and two threads hash in parallel (5.6 against 9.3 ms for the two 128 MB halves). :class:`Stream` is
that streaming state; where the module does not export them (another build of the package), it is the package's own,
GIL and all — same digests, slower beside a transfer. ``xxhash`` is pinned (``pyproject.toml``), and a unit test
compares both paths.

:meth:`Stream.copy_update` is a hand-off's land (:func:`common.kv.digest.copy_digest`): a piece copied in chunks that
stay in a core's cache, each chunk hashed right after it is written — one foreign call for the whole piece
(``common/kv/native/copy_hash.c``, built on first use like the attention kernel: :mod:`common.native_build`),
which loops over the chunks in C and calls the package's update by address. Without a compiler it is the same loop
in Python, two foreign calls per chunk on raw addresses (``ctypes.memmove``, then the hash), both outside the GIL
but each landing thread taking it back between them. Measured on a 2-core AMD EPYC Zen 4, 256 MB landed by
:func:`common.kv.digest.copy_digest` on two threads: numpy's ``copyto`` and the checked ``update`` per chunk (a few
microseconds of Python under the GIL each) 11.6 GB/s, the ctypes loop 15.2. On a 2-core Intel Xeon (AVX-512, AMX),
64 MB in a Ray actor (the transfer bench's receiver): the ctypes loop 7.5–10.7 ms on two threads, hardly better than
9.4–10.5 on one — the two threads queued for the GIL at every 256 KiB chunk — the C loop 5.5–8.0 ms; in one process,
two threads each landing half: 15.2 → 20.1 GB/s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from common.native_build import address, compiler, load_library

log = logging.getLogger("prism.kv.xxh3")


class _Lib:
    """The C functions, typed (an untyped ``ctypes`` call would pass a 64-bit pointer as a C ``int``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        self.create = _typed(lib.XXH3_createState, ptr, [])
        self.free = _typed(lib.XXH3_freeState, ctypes.c_int, [ptr])
        self.reset = _typed(lib.XXH3_64bits_reset, ctypes.c_int, [ptr])
        self.update = _typed(lib.XXH3_64bits_update_dispatch, ctypes.c_int, [ptr, ptr, size])
        self.digest = _typed(lib.XXH3_64bits_digest, ctypes.c_uint64, [ptr])


def _typed(fn: Any, restype: Any, argtypes: list[Any]) -> Any:
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def _load() -> _Lib | None:
    try:
        from xxhash import _xxhash

        return _Lib(ctypes.CDLL(_xxhash.__file__))
    except (ImportError, OSError, AttributeError):  # (another build of the package: no such exports)
        return None


_LIB = _load()
_memmove = ctypes.memmove
GIL_FREE = _LIB is not None
"""Whether :class:`Stream` hashes outside the GIL here."""


COPY_HASH_SOURCE = Path(__file__).with_name("native") / "copy_hash.c"


@functools.cache
def _copy_hash() -> Any | None:
    """The land's loop in C (``copy_hash.c``), built on first use (once per process; the build once per machine), or
    ``None`` — no compiler, or no C functions of the package to call — where :meth:`Stream.copy_update` loops here."""
    cc = compiler() if _LIB is not None else None
    if cc is None:
        return None
    try:
        library, _ = load_library(COPY_HASH_SOURCE, cc)
    except RuntimeError as exc:
        log.warning("the land's C loop is unavailable (%s): it loops in Python, two calls per chunk", exc)
        return None
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    loop = _typed(library.copy_hash, ctypes.c_int, [ptr, ptr, size, size, ptr, ptr])
    update = address(_LIB.update)  # (the package's function, by address)
    return functools.partial(_call_loop, loop, update)


def functions() -> tuple[int, int, int] | None:
    """The package's C ``update``, ``reset`` and ``digest`` by address — for C code that hashes on its own, never
    taking the GIL (:mod:`common.kv.hash_behind`) — or ``None`` where the module does not export them."""
    if _LIB is None:
        return None
    return address(_LIB.update), address(_LIB.reset), address(_LIB.digest)


def warm() -> bool:
    """Build (or load) the land's C loop now — a replica's start — rather than on its first hand-off's time; whether it
    is there."""
    return _copy_hash() is not None


def _call_loop(loop: Any, update: int, state: int, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
    status = loop(dst.ctypes.data, src.ctypes.data, dst.size, chunk, state, update)
    if status:
        raise RuntimeError(f"XXH3's update failed ({status})")


def _check_flat(method: str, *arrays: np.ndarray) -> None:
    """Refuse anything but flat C-contiguous ``uint8`` arrays: the C calls take a start address and a byte count."""
    for a in arrays:
        if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"Stream.{method} takes flat C-contiguous uint8 arrays")


class Stream:
    """An XXH3-64 stream (seed 0): ``update`` with flat ``uint8`` C-contiguous arrays, in order (or ``copy_update``:
    a copy whose written bytes it takes in); ``intdigest``; the same digest as ``xxhash.xxh3_64`` fed the same
    bytes."""

    def __init__(self) -> None:
        self._state: int | None = None
        self._py: Any = None
        if _LIB is None:
            self._py = xxhash.xxh3_64()
            return
        self._state = _LIB.create()
        if not self._state:
            raise MemoryError("XXH3 state")
        _LIB.reset(self._state)

    def update(self, data: np.ndarray) -> None:
        if self._py is not None:
            self._py.update(data)
            return
        _check_flat("update", data)
        if data.size:  # (``data`` stays referenced for the call: its memory cannot go away under the hash)
            _LIB.update(self._state, data.ctypes.data, data.size)

    def copy_update(self, dst: np.ndarray, src: np.ndarray, chunk: int) -> None:
        """Copy ``src`` into ``dst`` (flat C-contiguous ``uint8``, the same size; ``dst`` writable) ``chunk`` bytes
        at a time, and hash each chunk of ``dst`` right after it is written: the stream then holds ``dst``'s bytes."""
        _check_flat("copy_update", dst, src)
        if dst.size != src.size:
            raise ValueError(f"copy of {src.size} bytes into {dst.size}")
        if chunk <= 0:
            raise ValueError(f"chunks of {chunk} bytes")
        if not dst.flags.writeable:  # (a raw copy would not ask: a read-only mapping would fault, not raise)
            raise ValueError("assignment destination is read-only")
        if self._py is not None:
            for i in range(0, dst.size, chunk):
                np.copyto(dst[i : i + chunk], src[i : i + chunk])
                self._py.update(dst[i : i + chunk])
            return
        native = _copy_hash()
        if native is not None:  # (both arrays stay referenced for the call: their memory stays)
            native(self._state, dst, src, chunk)
            return
        to, size = dst.ctypes.data, dst.size  # (both arrays stay referenced for the calls: their memory stays)
        offset = src.ctypes.data - to
        for at in range(to, to + size, chunk):
            n = min(chunk, to + size - at)
            _memmove(at, at + offset, n)
            _LIB.update(self._state, at, n)

    @property
    def address(self) -> int | None:
        """The C state's address (what :func:`functions` take), or ``None`` on the package's own path."""
        return self._state

    def intdigest(self) -> int:
        return int(self._py.intdigest() if self._py is not None else _LIB.digest(self._state))

    def reset(self) -> None:
        if self._py is not None:
            self._py.reset()
        else:
            _LIB.reset(self._state)

    def __del__(self) -> None:
        if self._state is not None and _LIB is not None:
            _LIB.free(self._state)
            self._state = None
