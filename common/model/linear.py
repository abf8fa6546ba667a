"""The CPU path of a loaded model's linear layers: oneDNN with each weight packed once at load, and for a decode
step's few fp32 rows a kernel of Prism's own.

Why: PyTorch's ``F.linear`` in fp32 on the CPU calls MKL's ``sgemm``, and on the AMD EPYC (Zen 4) these machines have
MKL reaches about 75–100 GFLOP/s on a batch-32 decode step's weight GEMMs (32 rows) and about 150 on 512 rows, while
oneDNN with the weight reordered once into its blocked layout reaches about 160–175 and 213 on the same two cores
(``python -m loadtest.bench_decode`` records each path, ``b32_weight_gemm_ms``, ``b32_weight_gemm_ms_onednn`` and
``b32_weight_gemm_ms_torch``). oneDNN stays the path for many rows (encode, prefill). A call of at most 32 fp32 rows
(a decode step's) takes :mod:`common.model.row_gemm` instead where it runs (AVX-512, or AVX2 with FMA): on the Xeon of
2026-12-05 a whole decode step ran about 27 % faster at 1 and 8 rows and about 8 % at 32, and a row gets the same bits
in any batch of up to 32 rows — which oneDNN did not give at 1408 inputs (a 1-row call rounded differently from a row
among 5 or more), nor MKL (its 32-row kernel rounds row 0 differently from its 1-row kernel). So a batched step of up
to 32 sequences computes what each sequence alone would.

Lifecycle: :func:`pack_linears` runs once in :func:`common.model.loader.load_model`, after the weights are loaded and
before any stage sees the model. Each plain ``nn.Linear`` (subclasses are left alone) whose weight is fp32 or bf16 on
the CPU becomes a :class:`PackedLinear` (its class is swapped in place: the same module, parameters, ``state_dict`` and
hooks) holding a :class:`PackedWeight` beside its weight; its ``forward`` computes through it. The weights are read-only
from then on (the loader's contract already); a module moved or cast (``.to()``) or given a state dict packs again (or,
off the CPU or in a dtype this CPU has no packed product for, becomes a plain ``nn.Linear`` again), and a call with
autograd recording or an input of another dtype takes ``F.linear`` (oneDNN's op records no gradient and does not check
dtypes). Cost: every packed layer's weight is held twice (dense and blocked) — 97 MB more for ``prism-small-llava``'s
language model in fp32 — and a layer called with a few fp32 rows a third time, as the row kernel's panels (made on that
first call: 104 MB for that model's decode step, :mod:`common.model.row_gemm`). ``model.cpu_linear: torch`` keeps
PyTorch's own path (and the memory); so do a build without oneDNN, other devices and other dtypes;
``PRISM_NATIVE_GEMM=0`` keeps oneDNN for every call. A layer whose weight is tied to another module (an embedding) is
packed too: the packed copy only changes how the product is computed.
"""

from __future__ import annotations

import functools
import logging

import torch

from common.model.row_gemm import MAX_ROWS, RowGemm, load_row_gemm

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 32
"""The row count oneDNN lays the packed weight out for: a batched decode step's. Other row counts use the same
copy (measured: one packed for 32 rows serves 1 row as fast as one packed for 1)."""


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` computing through its packed weight (``packed``: oneDNN, or the row kernel for a few fp32
    rows), set by :func:`pack_linears`."""

    packed: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.packed.product(x, self.bias)

    def _apply(self, fn, recurse=True):  # (.to(), .float(), .cpu(), …: the packed copy follows the weight)
        out = super()._apply(fn, recurse)
        self.repack()
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()

    def repack(self) -> None:
        """Pack the weight as it is now, or become a plain ``nn.Linear`` where it can no longer be packed."""
        del self.packed
        self.__class__ = torch.nn.Linear
        if packable(self):
            pack(self)


class PackedWeight:
    """A weight in the layouts its products read: oneDNN's blocked copy (``onednn``) for every call, and for an fp32
    weight where :mod:`common.model.row_gemm` runs here, its panels for calls of at most
    :data:`~common.model.row_gemm.MAX_ROWS` rows — made on the first such call, so only layers a decode step
    calls hold them."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.onednn = _reorder(weight.detach(), BATCH_HINT)
        self.out_features, self.in_features = weight.shape
        self.rows = weight.dtype == torch.float32
        """Whether calls of a few rows may take the row kernel (fp32 only)."""
        self._source: torch.Tensor | None = weight if self.rows else None  # (the panels' source, let go once made)
        self._panels: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.onednn.dtype

    def row_panels(self, kernel: RowGemm) -> torch.Tensor:
        """The weight's panels for the row kernel, made on the first call that needs them."""
        panels, source = self._panels, self._source
        if panels is None:
            if source is None:  # (another thread made them between the two reads above)
                return self._panels  # type: ignore[return-value]
            panels = self._panels = kernel.pack(source)  # (two threads may both pack: the same bits, one kept)
            self._source = None
        return panels

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: the row kernel for a few fp32 rows where it runs, else oneDNN."""
        x = x.contiguous()
        if self.rows and x.dtype == torch.float32 and x.shape[-1] == self.in_features:
            kernel = load_row_gemm() if 0 < x.numel() <= MAX_ROWS * self.in_features else None
            if kernel is not None:
                out = kernel.product(x.view(-1, self.in_features), self.row_panels(kernel), self.out_features, bias)
                if out is not None:
                    return out.view(*x.shape[:-1], self.out_features)
        return self.onednn_product(x, bias)

    def onednn_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` through oneDNN on the blocked copy, whatever the rows."""
        # (contiguous: oneDNN reads a 2-D input with transposed strides as if it were row-major — checked, wrong
        # products — and it is a no-op on the contiguous activations a model passes)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.onednn, bias, "none", [], "")


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` (raises ``RuntimeError`` where this CPU has no kernel for its dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def available() -> bool:
    """oneDNN is built into this torch and exposes the packed linear ops (inductor's CPU path uses them too)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def packable(module: torch.nn.Module) -> bool:
    """A plain CPU ``nn.Linear`` of a packed dtype whose packed product works on this machine (:func:`usable`)."""
    return _candidate(module) and usable(module.weight.dtype)


def _candidate(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype in PACKED_DTYPES
        and w.dim() == 2
    )


@functools.cache
def usable(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear is built in and passes its check for ``dtype`` on this CPU — once per process (bf16
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only EPYC has fp32 only)."""
    return dtype in PACKED_DTYPES and available() and _works(dtype)


def pack(module: torch.nn.Linear) -> PackedLinear:
    """Swap ``module`` to a :class:`PackedLinear` in place (and return it)."""
    packed = PackedWeight(module.weight)
    module.__class__ = PackedLinear
    module.packed = packed
    return module  # type: ignore[return-value]


def pack_linears(model: torch.nn.Module) -> int:
    """Pack every packable linear layer of ``model`` (see the module docstring); returns how many. Layers of a dtype
    whose packed op is missing or fails its check on this machine keep PyTorch's linear (a warning per call)."""
    layers = [m for m in model.modules() if _candidate(m)]
    dtypes = {m.weight.dtype for m in layers}
    unusable = sorted(str(dtype) for dtype in dtypes if not usable(dtype))
    if unusable:
        log.warning("oneDNN's packed linear is not usable here for %s; those layers keep PyTorch's linear", unusable)
    packed = [pack(m) for m in layers if packable(m)]
    if any(m.weight.dtype == torch.float32 for m in packed):
        load_row_gemm()  # (built and checked at load, not in the first request that decodes)
    return len(packed)


def _works(dtype: torch.dtype) -> bool:
    """One small product through the packed path agrees with ``F.linear`` (to rounding): a build whose oneDNN
    lacks a kernel for ``dtype`` on this CPU raises or differs here, not in a request."""
    try:
        w = torch.linspace(-1, 1, 64 * 48).view(48, 64).to(dtype)
        x = torch.linspace(1, -1, 3 * 64).view(3, 64).to(dtype)
        got = PackedWeight(w).onednn_product(x, None)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), torch.nn.functional.linear(x, w).float(), rtol=tol, atol=tol))
    except RuntimeError as exc:  # (a CPU without the dtype's kernel: a fact of the machine, not a fault)
        log.warning("oneDNN's packed linear has no %s product on this CPU: %s", dtype, exc)
        return False
