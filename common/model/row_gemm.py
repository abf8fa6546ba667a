"""fp32 linear products of a few rows (``row_gemm.c``): a decode step's weight GEMMs, a row the same bits in any batch
of up to :data:`MAX_ROWS`.

Why: a decode step multiplies at most a batch of rows (32 by default) by every weight of the model. oneDNN's packed
kernels (:mod:`common.model.linear`), shaped for many rows, ran ``prism-small-llava``'s weight GEMMs on 32 rows at about
half the machine's FMA rate, and on 1408-column inputs rounded a 1-row call differently from a row among 5 or more
(measured on the 2-core Xeon of 2026-12-05): a sequence's down projection then depended on its batch. The C kernel
streams each weight once per call in panels of 32 columns and sums every output in one fixed order — a chain of fused
multiply-adds over the inputs from the first, then the bias — so a row's product does not depend on the rows, columns or
threads beside it (tested: 1 to 32 rows, fused and separate projections). A gated MLP's gate|up product can end in its
activation (:meth:`RowGemm.silu_mul`: ``silu(gate) * up`` stored from the registers, with the exp PyTorch's own silu
calls — SLEEF's ``Sleef_expf16_u10`` with AVX-512, ``Sleef_expf8_u10`` with AVX2, taken from libtorch — so the bits are
PyTorch's: :func:`gated_agrees` checks them once per process, and :mod:`common.engine.decode_forward` on each model's
weights). Calls of more rows go to oneDNN, so a decode batch over 32 (``engine.max_batch``) or a prefill chunk rounds as
oneDNN does. Measured on the Xeon; a CPU with AVX-512 elsewhere (AMD Zen 4) uses it too, checked but not timed there. A
CPU with AVX2 and FMA but no AVX-512 (an AMD EPYC of family 23, Zen 2) takes a 256-bit build of the same kernel — the
same bits; measured on that EPYC, ``prism-small-llava`` fp32 decode steps at batch 1 / 8 / 32 took 5.9–6.0 / 8.5–8.6 /
21.5–21.8 ms against oneDNN's 7.8–8.2 / 12.1–13.1 / 25.2–25.8 ms (``python -m loadtest.bench_decode --dtypes float32
--repeats 1``, each path twice, alternating).

Lifecycle: :func:`load_row_gemm` builds ``row_gemm.c`` on first use (once per machine, cached:
:mod:`common.native_build`) and checks it once per process against ``F.linear`` (to fp32 rounding) and against itself
across row counts (bit for bit). A CPU with neither AVX-512 nor AVX2 with FMA, no compiler, a failed check or
``PRISM_NATIVE_GEMM=0``: ``None``, and :mod:`common.model.linear` keeps oneDNN for every call (logged once). A weight's
panels (:meth:`RowGemm.pack`) are made by :class:`common.model.linear.PackedWeight` on its first call of at most
:data:`MAX_ROWS` rows, so only layers called with a few rows hold them (``prism-small-llava`` in fp32: 104 MB for a
decode step's layers — the gated gate|up panels among them, made by the decode forward when it starts — 55 MB more for
the separate projections once a prompt of at most 32 tokens is prefilled), and are read-only after.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from common.native_build import EXACT, address, load_optional

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_gemm.c")
PANEL = 32
"""Output columns per packed panel (``NR`` in ``row_gemm.c``)."""
MAX_ROWS = 32
"""The most rows a call takes through the kernel (a decode step's default batch); more go to oneDNN, which is
faster on a prefill's hundreds of rows (measured: 288 rows 44 ms there against 54 ms here)."""
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class RowGemm:
    """``product(x, panels, n, bias)`` = ``F.linear(x, weight, bias)`` for fp32 ``x`` of at most :data:`MAX_ROWS`
    rows, on ``pack(weight)``; ``silu_mul(x, panels, n, bias)`` = ``silu(x·gateᵀ) * (x·upᵀ)`` on
    ``pack_gated(gate, up)`` where :attr:`sleef_exp` is known."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.row_gemm_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]
        self._gated = library.row_gemm_f32_silu_mul  # (every build has it: one without SIMD refuses every call)
        self._gated.restype = ctypes.c_int
        self._gated.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, _PTR]
        self.exp_lanes = int(library.row_gemm_exp_lanes())
        """The lanes of the exp the library's gated product takes: 16 (its AVX-512 build) or 8 (AVX2)."""
        self.sleef_exp: int | None = None
        """The address of the exp PyTorch's kernels of this build's width call (SLEEF's), set by
        :func:`load_row_gemm` where it is found and :func:`gated_agrees` holds; ``None``: no :meth:`silu_mul`."""

    @property
    def address(self) -> int:
        """``row_gemm_f32``'s address (:mod:`common.engine.decode_layers` calls it from C)."""
        return address(self._fn)

    @property
    def gated_address(self) -> int:
        """``row_gemm_f32_silu_mul``'s address."""
        return address(self._gated)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (``[n, k]`` fp32) as panels ``[ceil(n / 32), k, 32]``: 32 output columns per panel, input-major,
        the columns past ``n`` zero."""
        n, k = weight.shape
        panels = -(-n // PANEL)
        padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()

    @staticmethod
    def pack_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """A gated MLP's ``gate`` and ``up`` weights (``[n, k]`` each, ``n`` a multiple of 16) as the panels of
        :meth:`silu_mul`: each panel 16 gate columns then the same 16 up columns."""
        return RowGemm.pack(interleave(gate.detach(), up.detach()))

    def silu_mul(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(x·gateᵀ + gate_bias) * (x·upᵀ + up_bias)`` ``[rows, n]`` on ``pack_gated(gate, up)`` (``bias``:
        ``interleave(gate_bias, up_bias)`` or ``None``), each product's bits those of :meth:`product` and the
        activation's those of PyTorch's ``silu`` and ``*``; ``None`` where it does not take the call."""
        if self.sleef_exp is None or 2 * n % PANEL:
            return None
        return self._run(self._gated, x, panels, 2 * n, bias, n, self.sleef_exp)

    def product(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` ``[rows, k]`` (fp32, contiguous) times the packed weight, plus ``bias``: ``[rows, n]``; ``None`` where
        the kernel does not take the call (the caller computes it another way)."""
        return self._run(self._fn, x, panels, n, bias, n)

    @staticmethod
    def _run(
        fn: Any, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None, out_n: int, *extra: Any
    ) -> torch.Tensor | None:
        """The C entry ``fn`` on ``x`` and the panels of an ``n``-column weight (``bias`` ``[n]``), into a new
        ``[rows, out_n]``; ``None`` where it does not take the call."""
        rows, k = x.shape
        if k == 0:  # (no inputs: the product is the bias alone, which the caller's other path gives)
            return None
        if panels.shape != (-(-n // PANEL), k, PANEL) or (bias is not None and not _plain(bias, (n,))):
            return None
        if not _plain(x, (rows, k)) or rows > MAX_ROWS:
            return None
        out = torch.empty(rows, out_n, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        status = fn(x.data_ptr(), panels.data_ptr(), b, out.data_ptr(), rows, n, k, torch.get_num_threads(), *extra)
        return None if status else out


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate`` and ``up`` (``[n, ...]``, ``n`` a multiple of 16) as ``[2n, ...]``: 16 gate rows, then the same 16 up
    rows, and so on — the order :meth:`RowGemm.pack_gated` packs a gate|up weight in (and its bias)."""
    n, rest = gate.shape[0], gate.shape[1:]
    return torch.stack([gate.reshape(n // 16, 16, *rest), up.reshape(n // 16, 16, *rest)], dim=1).reshape(2 * n, *rest)


def sleef_exp(lanes: int) -> int | None:
    """The address of SLEEF's exp of ``lanes`` lanes in this process's libtorch (``Sleef_expf16_u10``, which PyTorch's
    AVX-512 kernels call, its ``silu`` among them; ``Sleef_expf8_u10``, its AVX2 kernels'), or ``None`` where libtorch
    does not export it."""
    path = Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path))  # (already loaded by torch: the same handle)
        return ctypes.cast(getattr(library, f"Sleef_expf{lanes}_u10"), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _plain(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == shape


def agrees(kernel: RowGemm) -> bool:
    """Whether the kernel gives ``F.linear``'s products to fp32 rounding, with and without a bias, for column counts
    that fill panels and that do not, and a row the same bits whatever the rows beside it."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((96, 64), (70, 200)):
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        x = torch.randn(MAX_ROWS, k, generator=gen)
        panels = kernel.pack(weight)
        full = kernel.product(x, panels, n, bias)
        if full is None or not torch.allclose(full, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
            return False
        for rows in (1, 5, 17):
            part = kernel.product(x[:rows].contiguous(), panels, n, bias)
            if part is None or not torch.equal(part, full[:rows]):
                return False
        plain = kernel.product(x, panels, n, None)
        if plain is None or not torch.allclose(plain, x @ weight.T, rtol=1e-4, atol=1e-4):
            return False
    return True


def gated_agrees(kernel: RowGemm) -> bool:
    """Whether :meth:`RowGemm.silu_mul` gives PyTorch's ``silu(gate) * up`` of the kernel's own products bit for bit,
    with and without a bias, on 1, 5 and 32 rows of inputs large enough that silu's exp under- and overflows."""
    gen = torch.Generator().manual_seed(1)
    n, k = 64, 96
    gate, up = torch.randn(n, k, generator=gen), torch.randn(n, k, generator=gen)
    panels, separate = kernel.pack_gated(gate, up), kernel.pack(torch.cat([gate, up]))
    for bias in (None, torch.randn(2 * n, generator=gen)):
        for rows in (1, 5, MAX_ROWS):
            x = torch.randn(rows, k, generator=gen) * 8.0  # (gate values to ±300: exp's range and past it)
            both = kernel.product(x, separate, 2 * n, bias)
            got = kernel.silu_mul(x, panels, n, None if bias is None else interleave(bias[:n], bias[n:]))
            if both is None or got is None:
                return False
            if not torch.equal(got, torch.nn.functional.silu(both[:, :n]) * both[:, n:]):
                return False
    return True


@functools.cache
def load_row_gemm() -> RowGemm | None:
    """The kernel, built and checked once per process, or ``None`` (see the module docstring)."""
    loaded = load_optional(SOURCE, "PRISM_NATIVE_GEMM", "native row GEMM", "oneDNN for every linear", EXACT)
    if loaded is None:
        return None
    library, _ = loaded
    if not library.row_gemm_fast_path():
        log.info("native row GEMM needs AVX-512 or AVX2 with FMA, which this CPU lacks: oneDNN for every linear")
        return None
    kernel = RowGemm(library)
    with torch.inference_mode():
        if agrees(kernel):
            kernel.sleef_exp = sleef_exp(kernel.exp_lanes)
            if kernel.sleef_exp is not None and not gated_agrees(kernel):
                log.info("native row GEMM's silu * up differs from PyTorch's here: the activation stays PyTorch's")
                kernel.sleef_exp = None
            return kernel
    log.warning("native row GEMM failed its check against F.linear here: oneDNN for every linear")
    return None
