"""fp32 linear products of a few rows (``row_gemm.c``): a decode step's weight GEMMs, a row the same bits in any
batch of up to :data:`MAX_ROWS`.

Why: a decode step multiplies at most a batch of rows (32 by default) by every weight of the model. oneDNN's packed
kernels (:mod:`common.model.linear`), shaped for many rows, ran ``prism-small-llava``'s weight GEMMs on 32 rows at
about half the machine's FMA rate, and on 1408-column inputs rounded a 1-row call differently from a row among 5 or
more (measured on the 2-core Xeon of 2026-12-05): a sequence's down projection then depended on its batch. The C
kernel streams each weight once per call in panels of 32 columns and sums every output in one fixed order — a chain
of fused multiply-adds over the inputs from the first, then the bias — so a row's product does not depend on the
rows, columns or threads beside it (tested: 1 to 32 rows, fused and separate projections). Calls of more rows go to
oneDNN, so a decode batch over 32 (``engine.max_batch``) or a prefill chunk rounds as oneDNN does. Measured only on
the Xeon; a CPU with AVX-512 elsewhere (AMD Zen 4) uses it too, checked but not timed there.

Lifecycle: :func:`load_row_gemm` builds ``row_gemm.c`` on first use (once per machine, cached:
:mod:`common.native_build`) and checks it once per process against ``F.linear`` (to fp32 rounding) and against
itself across row counts (bit for bit). A CPU without AVX-512, no compiler, a failed check or ``PRISM_NATIVE_GEMM=0``:
``None``, and :mod:`common.model.linear` keeps oneDNN for every call (logged once). A weight's panels
(:meth:`RowGemm.pack`) are made by :class:`common.model.linear.PackedWeight` on its first call of at most
:data:`MAX_ROWS` rows, so only layers called with a few rows hold them (``prism-small-llava`` in fp32: 104 MB for a
decode step's layers, 55 MB more for the separate projections once a prompt of at most 32 tokens is prefilled), and
are read-only after.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from common.native_build import EXACT, load_optional

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
    rows, on ``pack(weight)``."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.row_gemm_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (``[n, k]`` fp32) as panels ``[ceil(n / 32), k, 32]``: 32 output columns per panel, input-major,
        the columns past ``n`` zero."""
        n, k = weight.shape
        panels = -(-n // PANEL)
        padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()

    def product(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` ``[rows, k]`` (fp32, contiguous) times the packed weight, plus ``bias``: ``[rows, n]``; ``None`` where
        the kernel does not take the call (the caller computes it another way)."""
        rows, k = x.shape
        if k == 0:  # (no inputs: the product is the bias alone, which the caller's other path gives)
            return None
        if panels.shape != (-(-n // PANEL), k, PANEL) or (bias is not None and not _plain(bias, (n,))):
            return None
        if not _plain(x, (rows, k)) or rows > MAX_ROWS:
            return None
        out = torch.empty(rows, n, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(),
            panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            k,
            torch.get_num_threads(),
        )
        return None if status else out


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


@functools.cache
def load_row_gemm() -> RowGemm | None:
    """The kernel, built and checked once per process, or ``None`` (see the module docstring)."""
    loaded = load_optional(SOURCE, "PRISM_NATIVE_GEMM", "native row GEMM", "oneDNN for every linear", EXACT)
    if loaded is None:
        return None
    library, _ = loaded
    if not library.row_gemm_fast_path():
        log.info("native row GEMM needs AVX-512, which this CPU lacks: oneDNN for every linear")
        return None
    kernel = RowGemm(library)
    with torch.inference_mode():
        if agrees(kernel):
            return kernel
    log.warning("native row GEMM failed its check against F.linear here: oneDNN for every linear")
    return None
