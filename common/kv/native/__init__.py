"""The CPU decode-attention kernel (``paged_decode_attention.c``): built on first use, loaded through ctypes.

Why a kernel of our own: on the CPU, a batched decode step's attention through PyTorch is one
``scaled_dot_product_attention`` call per sequence and layer (sequences attend over different block runs of the
pool, and PyTorch has no paged or varlen attention on the CPU): at batch 32 that is 256 calls a step, each costing
more in dispatch and scratch allocation than in reading its KV (profiled: 37 % of a batch-32 step, the KV read at
≈ 3–4 GB/s). The kernel reads every sequence's KV once, through its block table, where it lies in the pool, and
runs the whole batch of one layer in one call on ``torch.get_num_threads()`` threads of PyTorch's own OpenMP pool,
without the GIL.

Lifecycle: :func:`load_decode_kernel` compiles the C source once per machine with the system C compiler
(``cc -O3 -march=native -ffast-math -fopenmp``: built for the CPU it runs on, so the cache key holds the CPU's
flags) into ``$PRISM_NATIVE_CACHE`` (default ``~/.cache/prism/native``, else the temp dir), through a temporary file
renamed into place, so concurrent builders on one host (or sharing a mounted cache) never load a half-written
library; later calls, and later processes, load the cached build. Compiled and linked in two steps: ``-ffast-math``
lets the loops vectorise (glibc's vector ``expf`` included), but GCC < 13 *links* a shared library built with it
against ``crtfastmath.o``, whose constructor turns on flush-to-zero for the thread that loads it — every later
PyTorch op in that thread, and the threads it starts, would then round denormals differently; linking without the
flag keeps the process's floating-point mode untouched (tested). Without a compiler, with
``PRISM_NATIVE_ATTENTION=0``, or if no cache folder can take the library, it returns ``None`` and the engine keeps
PyTorch's per-sequence path (logged once) — the same tokens in fp32 up to float rounding, slower. The kernel takes
fp32 and bf16 (bf16 widened to fp32 and summed in fp32, rounded where PyTorch's CPU attention rounds: each exp, and
the output once — ``paged_decode_attention.c``); other dtypes, non-CPU pools and
shapes it does not take (query heads not a multiple of KV heads, …) use the PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("prism.kv.native")

SOURCE = Path(__file__).with_name("paged_decode_attention.c")
COMPILE = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK = ("-shared", "-fopenmp")  # (no -ffast-math here: see the module docstring)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class DecodeKernel:
    """``attend(query, keys, values, tables, lengths, scale)`` for one layer of one decode step."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fns = {torch.float32: library.paged_decode_attention, torch.bfloat16: library.paged_decode_attention_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]
            fn.argtypes += [ctypes.c_int]

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """``query`` ``[B, q_heads, 1, dim]``; ``keys``/``values`` one layer of the pool ``[blocks, block_size,
        kv_heads, dim]``; ``tables`` ``[B, width]`` int64 block ids; ``lengths`` ``[B]`` int64 tokens each sequence
        attends over. Returns ``[B, q_heads, 1, dim]``, or ``None`` when the kernel does not take these inputs
        (dtype, layout, head counts) or could not run (no scratch memory) — the caller then takes its own path."""
        batch, q_heads, _, dim = query.shape
        _, block_size, kv_heads, kv_dim = keys.shape
        if not (
            query.dtype == keys.dtype == values.dtype
            and query.dtype in self._fns
            and tables.dtype == lengths.dtype == torch.int64
            and keys.shape == values.shape
            and kv_dim == dim
            and kv_heads >= 1
            and q_heads % kv_heads == 0
            and keys.is_contiguous()
            and values.is_contiguous()
            and tables.is_contiguous()
            and lengths.is_contiguous()
            and tables.shape[0] == lengths.shape[0] == batch
        ):
            return None
        query = query.contiguous()
        out = torch.empty_like(query)
        status = self._fns[query.dtype](
            query.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            batch,
            q_heads,
            kv_heads,
            dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        return out if status == 0 else None


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


def _digest() -> str:
    material = SOURCE.read_bytes() + " ".join(COMPILE + LINK).encode() + platform.machine().encode()
    return hashlib.sha256(material + _cpu_key().encode()).hexdigest()[:16]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)


def _build_in(folder: Path, compiler: str, name: str) -> Path:
    """The library in ``folder``, built there first if it is not; raises ``OSError`` / ``SubprocessError``."""
    target = folder / name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".so")  # unique, even across hosts
    os.close(fd)
    obj = partial[: -len(".so")] + ".o"
    try:
        _run([compiler, *COMPILE, "-c", "-o", obj, str(SOURCE)])
        _run([compiler, *LINK, "-o", partial, obj, "-lm"])
        os.replace(partial, target)  # atomic: another process sees no library or a whole one
        return target
    finally:
        for leftover in (partial, obj):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


def _load(compiler: str) -> DecodeKernel:
    """Build (or find) and load the library from the first cache folder that can hold and load it."""
    name = f"paged_decode_attention-{_digest()}.so"
    errors = []
    for folder in _cache_dirs():
        try:
            path = _build_in(folder, compiler, name)
            return DecodeKernel(ctypes.CDLL(str(path)), path)  # (a noexec mount fails here: try the next folder)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{folder}: {(getattr(exc, 'stderr', None) or str(exc)).strip()}")
    raise RuntimeError("; ".join(errors))


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built on first use (once per process; the build itself once per machine), or ``None``."""
    if os.environ.get("PRISM_NATIVE_ATTENTION", "1") == "0":
        log.info("native decode attention turned off (PRISM_NATIVE_ATTENTION=0): PyTorch per-sequence attention")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention stays on PyTorch's per-sequence path (slower)")
        return None
    try:
        return _load(compiler)
    except RuntimeError as exc:
        log.warning("native decode attention unavailable (%s): PyTorch's per-sequence path (slower)", exc)
        return None
