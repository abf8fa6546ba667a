"""The decode step's roofline: the machine's measured read bandwidth and GEMM peak, and a step against them.

A decode step must read the language model's weights once (embedding table excluded: one row per token) and every
running sequence's KV, and compute its GEMMs (weights × rows, plus attention over the KV). Per step its **memory floor**
is those bytes at ``read_bytes_per_s`` — read probes on the engine's own torch threads (a sum over 256 MB), measured in
the same run — and its **compute floor** those FLOPs at ``gemm_flops_per_s``, the same weight GEMMs on 512 rows (the
peak the machine's GEMMs reach here: the faster of the model's own path and PyTorch's ``F.linear``); the step's floor is
the larger (``decode_roofline_fraction_b32``: that floor over the mean b32 step). Until 2026-12-03 the floor was the
bytes at a one-thread copy's bandwidth (``copy_floor_fraction``, kept beside it): a copy also writes, and the engine
reads on all its threads, so that bandwidth was well below what the engine can read (12.2 vs 21.4 GB/s in the committed
run) and the floor too high. Until 2026-12-06 the read probe summed memory on 4 KiB pages only; the same sum over memory
on 2 MiB pages (transparent huge pages, asked for with ``madvise``) reads faster here — 25.7 against 32.7 GB/s over
256 MB, 26.0 against 30.1 over 2 GB — so the machine reads at the faster rate, and the floor takes the faster probe
(both are recorded: ``read_bytes_per_s_by_pages``). The engine's KV pool is on 2 MiB pages already (allocated through
numpy, which advises every large array of its own onto huge pages); its packed weights (torch's) are on 4 KiB pages,
and moving them to 2 MiB pages did not make its step faster (prism-small-llava fp32, batch 32: 17.63 ms against 17.62,
medians of three runs each in alternating processes).

Lifecycle: :mod:`loadtest.bench_decode` measures the probes once per dtype (:func:`read_probes`, the weight GEMMs
on 32 and 512 rows), then places each engine run with :func:`roofline`. The copy probe
(:func:`memcpy_bytes_per_s`) is also the hand-off benchmark's yardstick (:mod:`loadtest.bench_transfer`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time

import numpy as np
import torch

from common.model.linear import PackedLinear
from common.model.loader import LoadedModel
from common.model.row_gemm import load_row_gemm


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # (Linux's value)


def read_probes(nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """A sum over ``nbytes`` of fp32 on torch's threads (the engine's own), best of ``repeats`` — a read probe; a copy
    (:func:`memcpy_bytes_per_s`) also writes, and on one thread — over memory on 4 KiB pages and over memory advised
    onto 2 MiB pages (where the kernel gives none, the second is plain pages too). Bytes per second by page size."""
    out = {}
    for name, huge in (("4KiB", False), ("2MiB", True)):
        x = torch.from_numpy(_region(nbytes, huge)).view(torch.float32)
        x.fill_(1.0)  # (first touch)
        x.sum()
        out[name] = nbytes / min(timed(lambda x=x: x.sum()) for _ in range(repeats))
        del x
    return out


def _region(nbytes: int, huge: bool) -> np.ndarray:
    """``nbytes`` untouched bytes; ``huge``: starting on a 2 MiB boundary and advised ``MADV_HUGEPAGE`` before their
    first touch, so they fault in as huge pages where transparent huge pages are on (``madvise`` or ``always``).
    Otherwise from torch's allocator, which advises nothing — not numpy's: numpy advises every large array of its own
    onto huge pages on Linux (so the KV pool, allocated through numpy, is on them already: ``common/kv/aligned.py``).
    At the probe's size (over glibc's largest mmap threshold, 32 MiB) either is a fresh mapping, never reused heap."""
    if not huge:
        return torch.empty(nbytes, dtype=torch.uint8).numpy()
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = np.zeros(span + HUGE_PAGE, np.uint8)
    start = -int(raw.ctypes.data) % HUGE_PAGE
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(int(raw.ctypes.data) + start, span, _MADV_HUGEPAGE)  # (advice: refused, the pages stay small)
    return raw[start : start + nbytes]


def weight_gemm_seconds(
    lm: LoadedModel, rows: int, repeats: int = 5, stock: bool = False, onednn: bool = False
) -> float:
    """The language model's own weight GEMMs (every linear layer and lm_head, each on its own as the model's forward
    calls them — by default the model's path, :mod:`common.model.linear`: the row kernel for a few fp32 rows where it
    runs, oneDNN on the packed weights otherwise; the decode step fuses q/k/v and gate/up,
    :mod:`common.engine.decode_forward`) on ``rows`` input rows, alone: a b32 step's compute floor, and (with many rows)
    the GEMM peak its prefill can reach. ``onednn``: oneDNN on the packed weights whatever the rows (the path before
    the row kernel); ``stock``: PyTorch's own ``F.linear`` on the dense weights (MKL in fp32), the path before
    packing."""
    layers = [m for m in lm.adapter.language_model(lm.model).modules() if isinstance(m, torch.nn.Linear)]
    layers.append(lm.model.lm_head)
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=lm.dtype) for m in layers}

    def product(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if stock:
            return torch.nn.functional.linear(x, m.weight, m.bias)
        if onednn and isinstance(m, PackedLinear):
            return m.packed.onednn_product(x, m.bias)
        return m(x)

    def run() -> None:
        with torch.inference_mode():
            for m in layers:
                product(m, inputs[m.in_features])

    run()
    return min(timed(run) for _ in range(repeats))


def linear_path(lm: LoadedModel) -> str:
    """How the model's linear layers compute (:mod:`common.model.linear`): ``row kernel + onednn`` (a few fp32 rows
    in the row kernel, more in oneDNN), ``onednn`` or ``torch``."""
    if not any(isinstance(m, PackedLinear) for m in lm.model.modules()):
        return "torch"
    return "row kernel + onednn" if lm.dtype == torch.float32 and load_row_gemm() is not None else "onednn"


def lm_weight_bytes(lm: LoadedModel) -> int:
    lang = lm.adapter.language_model(lm.model)
    embed = lang.get_input_embeddings().weight
    params = [p for p in lang.parameters() if p is not embed] + list(lm.model.lm_head.parameters())
    return sum(p.numel() * p.element_size() for p in params)


def kv_bytes_per_token(lm: LoadedModel) -> int:
    layers, heads, dim = lm.kv_shape
    return 2 * layers * heads * dim * lm.dtype.itemsize


def gemm_flops_per_token(lm: LoadedModel) -> int:
    return 2 * lm_weight_bytes(lm) // lm.dtype.itemsize


def step_floor_ms(run: dict, read: float, peak: float) -> float:
    """The larger of a run's memory and compute floors per step (:func:`roofline`), in ms."""
    line = roofline(run, read, peak)
    return max(line["memory_floor_ms"], line["compute_floor_ms"])


def serial_floor_ms(run: dict, read: float, peak: float) -> float:
    """The floor of a step that runs its weight GEMMs and then its attention, one phase after the other (a layer's
    attention needs its q|k|v product, and its o projection the attention's output), each phase at the larger of its
    own memory floor (weights; the KV) and compute floor (the weight GEMMs' FLOPs; the attention's), in ms: the
    shortest step that does not overlap a layer's attention with GEMMs, whatever its kernels."""
    kv, attention = run["kv_bytes_per_step"], run["attention_flops_per_step"]
    weights_ms = max((run["bytes_per_step"] - kv) / read, (run["flops_per_step"] - attention) / peak)
    return 1000 * (weights_ms + max(kv / read, attention / peak))


def roofline(run: dict, read: float, peak: float) -> dict:
    """One engine run against the roofline: per step, the memory floor (its bytes at the ``read`` bandwidth of the
    engine's threads) and the compute floor (its FLOPs at the ``peak`` GEMM rate), the step's floor the larger."""
    memory_ms = 1000 * run["bytes_per_step"] / read
    compute_ms = 1000 * run["flops_per_step"] / peak
    return {
        "memory_floor_ms": memory_ms,
        "compute_floor_ms": compute_ms,
        "bound": "memory" if memory_ms >= compute_ms else "compute",
        # the floor over the mean step (the run's steps over its time)
        "floor_fraction": max(memory_ms, compute_ms) * run["steps"] / (1000 * run["seconds"]),
    }
