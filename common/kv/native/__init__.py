"""The CPU decode-attention kernel (``paged_decode_attention.c``): built on first use, loaded through ctypes.

Why a kernel of our own: on the CPU, a batched decode step's attention through PyTorch is one
``scaled_dot_product_attention`` call per sequence and layer (sequences attend over different block runs of the
pool, and PyTorch has no paged or varlen attention on the CPU): at batch 32 that is 256 calls a step, each costing
more in dispatch and scratch allocation than in reading its KV (profiled: 37 % of a batch-32 step, the KV read at
≈ 3–4 GB/s). The kernel reads every sequence's KV once, through its block table, where it lies in the pool, and
runs the whole batch of one layer in one call on ``torch.get_num_threads()`` threads of PyTorch's own OpenMP pool,
without the GIL.

Lifecycle: :func:`load_decode_kernel` compiles the C source once per machine with the system C compiler
(``cc``, ``-O3 -march=native -fopenmp``: built for the CPU it runs on, so the cache key holds the CPU's flags) into
``$PRISM_NATIVE_CACHE`` (default ``~/.cache/prism/native``, else the temp dir), atomically, so concurrent replicas
on one host never load a half-written library; later calls, and later processes, load the cached build. Without a
compiler, or with ``PRISM_NATIVE_ATTENTION=0``, it returns ``None`` and the engine keeps PyTorch's per-sequence path
(logged once) — the same tokens in fp32 up to float rounding, slower. The kernel is fp32 only; other dtypes and
non-CPU pools use the PyTorch path.
"""

from __future__ import annotations

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
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class DecodeKernel:
    """``attend(query, keys, values, tables, lengths, scale)`` for one layer of one decode step."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.paged_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]
        self._fn.argtypes += [ctypes.c_int]

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
        attends over. Returns ``[B, q_heads, 1, dim]``, or ``None`` if the kernel could not run (no scratch memory to
        be had) — the caller then takes its own path."""
        batch, q_heads, _, dim = query.shape
        _, block_size, kv_heads, _ = keys.shape
        query = query.contiguous()
        if not (keys.is_contiguous() and values.is_contiguous() and tables.is_contiguous()):
            raise ValueError("the kernel reads the pool's layers, tables and lengths as contiguous arrays")
        out = torch.empty_like(query)
        status = self._fn(
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


def _build(compiler: str) -> Path:
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode() + _cpu_key().encode()
    ).hexdigest()[:16]
    errors = []
    for folder in _cache_dirs():
        target = folder / f"paged_decode_attention-{digest}.so"
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{target.name}.{os.getpid()}"
            subprocess.run(
                [compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            os.replace(partial, target)  # atomic: another process sees no library or a whole one
            return target
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            errors.append(f"{folder}: {detail}")
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
        path = _build(compiler)
        return DecodeKernel(ctypes.CDLL(str(path)), path)
    except (RuntimeError, OSError) as exc:
        log.warning("native decode attention unavailable (%s): PyTorch's per-sequence path (slower)", exc)
        return None
