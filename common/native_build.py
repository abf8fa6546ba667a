"""Builds and loads Prism's C sources (``common/kv/native/*.c``, ``common/model/row_gemm.c``,
``common/engine/decode_layers.c``, ``common/grammar/masks.c``) with the machine's C compiler: once per machine, cached.

Lifecycle: :func:`load_library` compiles a source with the system C compiler (``cc -O3 -march=native -ffast-math
-fopenmp``: built for the CPU it runs on, so the cache key holds the CPU's flags, the source, the headers beside it
and the flags) into ``$PRISM_NATIVE_CACHE`` (default ``~/.cache/prism/native``, else the temp dir), through a
temporary file renamed into place, so concurrent builders on one host (or sharing a mounted cache) never load a
half-written library; later calls, and later processes, load the cached build. Compiled and linked in two steps:
``-ffast-math`` lets loops vectorise (glibc's vector ``expf`` included), but GCC < 13 *links* a shared library built
with it against ``crtfastmath.o``, whose constructor turns on flush-to-zero for the thread that loads it — every later
PyTorch op in that thread, and the threads it starts, would then round denormals differently; linking without the
flag keeps the process's floating-point mode untouched (tested). It raises ``RuntimeError`` (saying why, per cache
folder) when no folder can build and load it; each caller decides what runs instead (:mod:`common.kv.native`,
:mod:`common.kv.xxh3`, :mod:`common.model.row_gemm`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

COMPILE = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
EXACT = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC")
"""For a source whose arithmetic must round as PyTorch's ops do, op by op: no fast-math (which lets the compiler
reorder sums and turn divisions into reciprocals) and no fused multiply-adds."""
LINK = ("-shared", "-fopenmp")  # (no -ffast-math here: see the module docstring)

log = logging.getLogger("prism.native")


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the path; ``None`` when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load_optional(
    source: Path, switch: str, what: str, instead: str, flags: tuple[str, ...] = COMPILE
) -> tuple[ctypes.CDLL, Path] | None:
    """``source`` built and loaded (:func:`load_library`) for a kernel that has a slower path beside it, or ``None``
    where it will not be: the environment variable ``switch`` is ``0``, there is no compiler, or no cache folder can
    build it — each logged once, naming ``what`` and what runs ``instead``."""
    if os.environ.get(switch, "1") == "0":
        log.info("%s turned off (%s=0): %s", what, switch, instead)
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: %s unavailable, %s", what, instead)
        return None
    try:
        return load_library(source, cc, flags)
    except RuntimeError as exc:
        log.warning("%s unavailable (%s): %s", what, exc, instead)
        return None


def address(fn: ctypes._CFuncPtr) -> int:
    """A loaded library's function as the address C code calls it by (one kernel's driver calling another's)."""
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def load_library(source: Path, compiler: str, flags: tuple[str, ...] = COMPILE) -> tuple[ctypes.CDLL, Path]:
    """``source`` built (or found built) with ``flags`` in the first cache folder that can hold and load it: the
    library and its path. Raises ``RuntimeError`` when none can."""
    name = f"{source.stem}-{_digest(source, flags)}.so"
    errors = []
    for folder in _cache_dirs():
        try:
            path = _build_in(folder, compiler, source, name, flags)
            return ctypes.CDLL(str(path)), path  # (a noexec mount fails here: try the next folder)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{folder}: {(getattr(exc, 'stderr', None) or str(exc)).strip()}")
    raise RuntimeError("; ".join(errors))


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _cache_dirs() -> list[Path]:
    configured = os.environ.get("PRISM_NATIVE_CACHE")
    if configured:
        return [Path(configured)]
    return [Path.home() / ".cache" / "prism" / "native", Path(tempfile.gettempdir()) / "prism-native"]


def _digest(source: Path, flags: tuple[str, ...] = COMPILE) -> str:
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # (what a source may include)
    material = source.read_bytes() + headers + " ".join(flags + LINK).encode() + platform.machine().encode()
    return hashlib.sha256(material + _cpu_key().encode()).hexdigest()[:16]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def _build_in(folder: Path, compiler: str, source: Path, name: str, flags: tuple[str, ...] = COMPILE) -> Path:
    """The library in ``folder``, built there first if it is not; raises ``OSError`` / ``SubprocessError``."""
    target = folder / name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".so")  # unique, even across hosts
    os.close(fd)
    obj = partial[: -len(".so")] + ".o"
    try:
        _run([compiler, *flags, "-c", "-o", obj, str(source)])
        _run([compiler, *LINK, "-o", partial, obj, "-lm"])
        os.replace(partial, target)  # atomic: another process sees no library or a whole one
        return target
    finally:
        for leftover in (partial, obj):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
