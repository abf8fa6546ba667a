"""The decode step's residual adds and RMSNorms in C (``rms_norm.c``), bit for bit PyTorch's — or not at all.

Why: transformers' RMSNorm is seven PyTorch ops, and the residual add before it an eighth; on a decode step's few rows
each op costs more in dispatch than in arithmetic (``prism-small-llava``'s 17 norms a step took about 1 ms of a
batch-32 step). One foreign call does the add and the norm of every row, the rows split over PyTorch's threads (a
row's bits do not depend on the thread: tested).

Exactness: ``rms_norm.c`` rounds every op as PyTorch does; its sum follows ATen's summation order for vectors of the
width ATen runs at here (16 lanes with AVX-512, 8 with AVX2, 4 with 128-bit vectors). :func:`load_norm_kernel` builds
it (without fast-math or fused multiply-adds: :data:`common.native_build.EXACT`), then checks it once per process
against PyTorch's own ops on random rows (fp32 and bf16, with and without the add) at each width, and keeps the width
that agrees bit for bit on all of them (8 on the 2-core Xeon of 2026-12-05; 16 and 4 disagreed there). None
agreeing, no compiler, or ``PRISM_NATIVE_NORM=0``: ``None``, and the caller keeps PyTorch's ops (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from common.native_build import EXACT, address, load_optional

log = logging.getLogger("prism.kv.native")

SOURCE = Path(__file__).with_name("rms_norm.c")
LANES = (16, 8, 4)
"""The vector widths ATen's CPU kernels run at (AVX-512, AVX2, 128-bit vectors: NEON / SSE), tried in this order."""
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def torch_rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` / ``Qwen2VLRMSNorm`` forward, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def torch_add_norm(
    h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :meth:`NormKernel.add_norm` computes, through PyTorch's ops: ``(h + add, rms_norm(h + add))`` (``h`` as
    it is without ``add``) — also every path's answer where the kernel is not used."""
    total = h if add is None else h + add
    return total, torch_rms_norm(weight, eps, total)


class NormKernel:
    """``add_norm(h, add, weight, eps)`` → ``(h + add, rms_norm(h + add))`` (``add`` may be ``None``: ``(h, norm)``)."""

    def __init__(self, library: ctypes.CDLL, lanes: int) -> None:
        self.lanes = lanes
        """The vector width whose summation order agreed with PyTorch's here."""
        self._fns = {torch.float32: library.rms_norm_f32, torch.bfloat16: library.rms_norm_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _I64, ctypes.c_int]

    def address(self, dtype: torch.dtype) -> int:
        """The C entry point's address for ``dtype`` (:mod:`common.engine.decode_layers` calls it from C)."""
        return address(self._fns[dtype])

    def add_norm(
        self, h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h + add`` (``h`` itself without ``add``) and its norm, both ``h``'s shape."""
        n = h.shape[-1]
        if not self.takes(h, add, weight):
            return torch_add_norm(h, add, weight, eps)
        total = h if add is None else torch.empty_like(h)
        out = torch.empty_like(h)
        status = self._fns[h.dtype](
            h.data_ptr(),
            None if add is None else add.data_ptr(),
            None if add is None else total.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            h.numel() // n,
            n,
            eps,
            self.lanes,
            torch.get_num_threads(),
        )
        if status != 0:  # (no scratch memory: the rows are computed again here)
            return torch_add_norm(h, add, weight, eps)
        return total, out

    def takes(self, h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor) -> bool:
        return (
            h.dtype in self._fns
            and weight.dtype == h.dtype
            and h.is_contiguous()
            and weight.is_contiguous()
            and weight.shape == (h.shape[-1],)
            and h.shape[-1] > 0
            and (add is None or (add.dtype == h.dtype and add.shape == h.shape and add.is_contiguous()))
        )


def agrees(kernel: NormKernel, hidden: int, eps: float = 1e-6) -> bool:
    """Whether ``kernel`` gives PyTorch's bits on random rows of ``hidden`` (fp32 and bf16, 1 and 32 rows, with and
    without the residual add; rows of several scales, as a model's residual stream grows)."""
    gen = torch.Generator().manual_seed(hidden)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 32):
            scale = torch.logspace(-2, 2, rows).view(rows, 1, 1)
            h = (torch.randn(rows, 1, hidden, generator=gen) * scale).to(dtype)
            add = (torch.randn(rows, 1, hidden, generator=gen) * scale).to(dtype)
            weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
            total, out = kernel.add_norm(h, add, weight, eps)
            if not (torch.equal(total, h + add) and torch.equal(out, torch_rms_norm(weight, eps, h + add))):
                return False
            if not torch.equal(kernel.add_norm(h, None, weight, eps)[1], torch_rms_norm(weight, eps, h)):
                return False
    return True


@functools.cache
def load_norm_kernel(hidden: int) -> NormKernel | None:
    """The kernel for rows of ``hidden``, checked against PyTorch here (once per process and width), or ``None``."""
    loaded = load_optional(SOURCE, "PRISM_NATIVE_NORM", "native RMSNorm", "PyTorch's ops", EXACT)
    if loaded is None:
        return None
    library, _ = loaded
    with torch.inference_mode():
        for lanes in LANES:
            kernel = NormKernel(library, lanes)
            if agrees(kernel, hidden):
                return kernel
    log.warning("native RMSNorm differs from PyTorch's here at every vector width: PyTorch's ops")
    return None
