"""The CPU decode-attention kernel (``paged_decode_attention.c``): built on first use, loaded through ctypes.

Why a kernel of our own: on the CPU, a batched decode step's attention through PyTorch is one
``scaled_dot_product_attention`` call per sequence and layer (sequences attend over different block runs of the
pool, and PyTorch has no paged or varlen attention on the CPU): at batch 32 that is 256 calls a step, each costing
more in dispatch and scratch allocation than in reading its KV (profiled: 37 % of a batch-32 step, the KV read at
≈ 3–4 GB/s). The kernel reads every sequence's KV once, through its block table, where it lies in the pool, and
runs the whole batch of one layer in one call on ``torch.get_num_threads()`` threads of PyTorch's own OpenMP pool,
without the GIL.

Lifecycle: :func:`load_decode_kernel` builds the C source on first use — once per machine, cached, for the CPU it
runs on (:mod:`common.kv.native.build`, which says how and why it links as it does) — and loads it. Without a
compiler, with ``PRISM_NATIVE_ATTENTION=0``, or if no cache folder can take the library, it returns ``None`` and the
engine keeps PyTorch's per-sequence path (logged once) — the same tokens in fp32 up to float rounding, slower. The
kernel takes fp32 and bf16 (bf16 widened to fp32 and summed in fp32, rounded where PyTorch's CPU attention rounds:
each exp, and the output once — ``paged_decode_attention.c``); other dtypes, non-CPU pools and shapes it does not
take (query heads not a multiple of KV heads, …) use the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from common.kv.native.build import compiler, load_library

log = logging.getLogger("prism.kv.native")

SOURCE = Path(__file__).with_name("paged_decode_attention.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class DecodeKernel:
    """``attend(query, keys, values, tables, lengths, scale)`` for one layer of one decode step."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.fast_path = bool(library.paged_decode_attention_fast_path())
        """Whether this build has the AVX-512 loops (head sizes 64 and 128, 1 to 8 query heads per KV head)."""
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


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built on first use (once per process; the build itself once per machine), or ``None``."""
    if os.environ.get("PRISM_NATIVE_ATTENTION", "1") == "0":
        log.info("native decode attention turned off (PRISM_NATIVE_ATTENTION=0): PyTorch per-sequence attention")
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: decode attention stays on PyTorch's per-sequence path (slower)")
        return None
    try:
        return DecodeKernel(*load_library(SOURCE, cc))
    except RuntimeError as exc:
        log.warning("native decode attention unavailable (%s): PyTorch's per-sequence path (slower)", exc)
        return None
