"""fp32 products of a decode step's few rows in C: ``F.linear``'s to rounding, each row the same bits in any batch and
beside any columns, checked before use; every way it can be unavailable leaves oneDNN."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from common import native_build
from common.model import linear, row_gemm
from common.model.linear import PackedLinear, pack
from common.native_build import EXACT, compiler, load_library

FLAGS = set(" ".join(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
AVX512 = "avx512f" in FLAGS
AVX2 = {"avx2", "fma"} <= FLAGS


@pytest.fixture(scope="module")
def kernel():
    found = row_gemm.load_row_gemm()
    if not AVX2:
        assert found is None
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: the kernel is not used (oneDNN for every linear)")
    assert found is not None, (
        "a C compiler and AVX2/AVX-512 are on this machine: the kernel must build and pass its check"
    )
    return found


@pytest.fixture(scope="module")
def gated(kernel):
    """The kernel with its gated product: SLEEF's exp of the build's width (16 lanes with AVX-512, 8 with AVX2), the
    one PyTorch's silu calls on this CPU."""
    assert kernel.exp_lanes == (16 if AVX512 else 8)
    assert kernel.sleef_exp is not None, "libtorch exports SLEEF's exp on this machine: the gated product must be on"
    assert kernel.gated_address is not None
    return kernel


@pytest.mark.parametrize("n,k", [(1408, 512), (512, 1408), (4096, 512), (70, 200), (17, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_are_f_linears_and_a_row_is_the_same_in_any_batch(kernel, n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(row_gemm.MAX_ROWS, k, generator=gen)
    panels = kernel.pack(weight)
    assert panels.shape == (-(-n // row_gemm.PANEL), k, row_gemm.PANEL)
    full = kernel.product(x, panels, n, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 13, 14, 15, 31):
        assert torch.equal(kernel.product(x[:rows].contiguous(), panels, n, b), full[:rows])


def test_a_column_does_not_depend_on_the_columns_beside_it(kernel):
    """What lets the decode step fuse q|k|v and gate|up into one product each: every projection's own bits."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, 256, generator=gen) for n in (512, 128, 128)]
    x = torch.randn(9, 256, generator=gen)
    fused = kernel.product(x, kernel.pack(torch.cat(parts)), 768, None)
    alone = torch.cat([kernel.product(x, kernel.pack(w), w.shape[0], None) for w in parts], dim=-1)
    assert torch.equal(fused, alone)


def test_the_thread_count_does_not_change_a_bit(kernel):
    """(1000 columns: the last panel, 8 columns wide, falls to the last thread in every split.)"""
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(1000, 512, generator=gen), torch.randn(32, 512, generator=gen)
    panels = kernel.pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.product(x, panels, 1000, None)
        torch.set_num_threads(2)
        two = kernel.product(x, panels, 1000, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, x @ weight.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_the_gated_product_is_pytorchs_silu_of_gate_times_up_bit_for_bit(gated, bias):
    """gate|up packed 16 columns of each to a panel, ending in silu(gate) * up: the products' own bits (as the fused
    product gives them) through PyTorch's silu and multiply, in any batch; inputs large enough that exp under- and
    overflows."""
    kernel = gated
    gen = torch.Generator().manual_seed(5)
    n, k = 1408, 512
    gate, up = torch.randn(n, k, generator=gen) / 8, torch.randn(n, k, generator=gen) / 8
    b = torch.randn(2 * n, generator=gen) if bias else None
    x = torch.randn(row_gemm.MAX_ROWS, k, generator=gen) * torch.logspace(-2, 1.5, row_gemm.MAX_ROWS)[:, None]
    both = kernel.product(x, kernel.pack(torch.cat([gate, up])), 2 * n, b)
    want = torch.nn.functional.silu(both[:, :n]) * both[:, n:]
    gb = None if b is None else row_gemm.interleave(b[:n], b[n:])
    panels = kernel.pack_gated(gate, up)
    got = kernel.silu_mul(x, panels, n, gb)
    assert torch.equal(got, want) and both[:, :n].min() < -90 and both[:, :n].max() > 90
    for rows in (1, 7, 14, 15):
        assert torch.equal(kernel.silu_mul(x[:rows].contiguous(), panels, n, gb), want[:rows])


def test_the_gated_product_refuses_what_it_does_not_take_and_a_wrong_exp_fails_its_check(gated, monkeypatch):
    kernel = gated
    gen = torch.Generator().manual_seed(6)
    gate, up = torch.randn(40, 64, generator=gen), torch.randn(40, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    padded = kernel.pack(torch.cat([gate, up]))  # (80 columns: not whole panels — the C refuses them too)
    assert kernel.silu_mul(x, padded, 40, None) is None
    panels = kernel.pack_gated(gate[:32], up[:32])
    assert kernel.silu_mul(torch.randn(row_gemm.MAX_ROWS + 1, 64), panels, 32, None) is None
    assert kernel.silu_mul(x, panels, 32, torch.ones(63)) is None
    assert row_gemm.interleave(torch.arange(32), 100 + torch.arange(32))[14:18].tolist() == [14, 15, 100, 101]
    monkeypatch.setattr(kernel, "sleef_exp", None)
    assert kernel.silu_mul(x, panels, 32, None) is None
    libtorch = ctypes.CDLL(str(Path(torch.__file__).with_name("lib") / "libtorch_cpu.so"))
    exp2 = getattr(libtorch, f"Sleef_exp2f{kernel.exp_lanes}_u10")  # (2^x: the same width, the wrong function)
    monkeypatch.setattr(kernel, "sleef_exp", ctypes.cast(exp2, ctypes.c_void_p).value)
    assert not row_gemm.gated_agrees(kernel)


def test_calls_it_does_not_take_return_none(kernel):
    panels = kernel.pack(torch.randn(64, 32))
    assert kernel.product(torch.randn(row_gemm.MAX_ROWS + 1, 32), panels, 64, None) is None  # (too many rows)
    assert kernel.product(torch.randn(4, 32, dtype=torch.float64), panels, 64, None) is None
    assert kernel.product(torch.randn(32, 4).t(), panels, 64, None) is None  # (not contiguous)
    assert kernel.product(torch.randn(4, 16), panels, 64, None) is None  # (another input width)
    assert kernel.product(torch.randn(4, 32), panels, 64, torch.ones(63)) is None  # (a bias of another width)
    assert kernel.product(torch.randn(4, 32), panels, 64, torch.ones(64, dtype=torch.float64)) is None
    assert kernel.product(torch.randn(4, 0), kernel.pack(torch.randn(64, 0)), 64, None) is None  # (no inputs)


def test_turned_off_or_without_a_compiler_there_is_no_kernel(monkeypatch):
    row_gemm.load_row_gemm.cache_clear()
    try:
        monkeypatch.setenv("PRISM_NATIVE_GEMM", "0")
        assert row_gemm.load_row_gemm() is None
        monkeypatch.delenv("PRISM_NATIVE_GEMM")
        monkeypatch.setattr(native_build, "compiler", lambda: None)
        assert row_gemm.load_row_gemm() is None
    finally:
        row_gemm.load_row_gemm.cache_clear()


def test_a_packed_layer_takes_the_kernel_for_a_few_fp32_rows_and_onednn_for_more(kernel, monkeypatch):
    torch.manual_seed(0)
    stock = torch.nn.Linear(1408, 512)
    packed = pack(torch.nn.Linear(1408, 512))
    packed.load_state_dict(stock.state_dict())
    assert isinstance(packed, PackedLinear)
    assert row_gemm.load_row_gemm() is not None  # (loaded and checked before the calls are counted)
    calls = []
    product = row_gemm.RowGemm.product
    monkeypatch.setattr(row_gemm.RowGemm, "product", lambda self, *a: calls.append(a[0].shape[0]) or product(self, *a))
    x = torch.randn(300, 1408)
    with torch.inference_mode():
        few, many = packed(x[:32]), packed(x)
        torch.testing.assert_close(few, stock(x[:32]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(many, stock(x), rtol=1e-5, atol=1e-5)
        assert calls == [32]  # (300 rows: oneDNN)
        assert torch.equal(packed(x[:1]), few[:1])  # (oneDNN rounded this row differently alone, at 1408 inputs)
        monkeypatch.setattr(linear, "load_row_gemm", lambda: None)
        torch.testing.assert_close(packed(x[:32]), few, rtol=1e-5, atol=1e-5)  # (oneDNN when there is no kernel)
    assert calls == [32, 1]


def test_a_build_without_avx2_says_so_and_takes_no_call():
    """What a CPU with neither AVX-512 nor AVX2 gets: the library builds, reports no fast path, and refuses every call,
    so ``load_row_gemm`` gives ``None`` and oneDNN computes."""
    library, _ = load_library(row_gemm.SOURCE, compiler(), (*EXACT, "-mno-avx512f", "-mno-avx2"))
    assert library.row_gemm_fast_path() == 0 and library.row_gemm_exp_lanes() == 0
    assert library.row_gemm_f32(None, None, None, None, 1, 1, 1, 1) == 1


def _fma_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel claims to compute, step by step: each output one fused multiply-add per input from zero, in
    input order (the product of two fp32 values is exact in fp64, the sum rounded to fp32 once per step — the rare
    case where fp64's own rounding would tie fp32's does not occur for these seeds), then the bias added once."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (acc.double() + x[:, k, None].double() * weight[None, :, k].double()).float()
    return acc if bias is None else acc + bias


def test_every_product_is_one_fma_chain_in_input_order_then_the_bias(kernel):
    """The bits themselves, on any CPU the kernel runs on (AVX-512 or AVX2): a partial last panel, 1 to 32 rows."""
    gen = torch.Generator().manual_seed(8)
    for n, k, bias in ((70, 200, True), (33, 64, False), (5, 17, True)):
        weight, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None
        x = torch.randn(row_gemm.MAX_ROWS, k, generator=gen)
        panels = kernel.pack(weight)
        want = _fma_chain(x, weight, b)
        assert torch.equal(kernel.product(x, panels, n, b), want), (n, k)
        for rows in (1, 2, 3, 4, 7):
            assert torch.equal(kernel.product(x[:rows].contiguous(), panels, n, b), want[:rows]), (n, k, rows)


def test_the_avx2_build_gives_the_kernels_bits_and_its_gated_product_takes_the_8_lane_exp(kernel):
    """Built without AVX-512 (what an AVX2-only CPU loads): every product the same bits as the kernel this machine
    loaded — on a CPU with AVX-512, the 512-bit build's (on an AVX2-only CPU the same build: the test above holds each
    to the chain itself) — since each output is the same chain of FMAs; its gated product takes SLEEF's 8-lane exp
    (PyTorch's AVX2 one: held bit for bit to PyTorch's silu by the gated tests on an AVX2-only CPU; to rounding here).
    """
    library, _ = load_library(row_gemm.SOURCE, compiler(), (*EXACT, "-mno-avx512f"))
    assert library.row_gemm_fast_path() == 1 and library.row_gemm_exp_lanes() == 8
    avx2 = row_gemm.RowGemm(library)
    assert avx2.exp_lanes == 8 and avx2.gated_address is not None
    avx2.sleef_exp = row_gemm.sleef_exp(8)
    assert avx2.sleef_exp is not None, "libtorch exports SLEEF's 8-lane exp"
    gen = torch.Generator().manual_seed(9)
    gate, up = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)
    separate, gated = avx2.pack(torch.cat([gate, up])), avx2.pack_gated(gate, up)
    for bias in (None, torch.randn(128, generator=gen)):
        gb = None if bias is None else row_gemm.interleave(bias[:64], bias[64:])
        for rows in (1, 2, 3, 4, 32):  # (tiles of 1, 2 and 3 rows)
            x = torch.randn(rows, 96, generator=gen) * 4
            both = avx2.product(x, separate, 128, bias)
            want = torch.nn.functional.silu(both[:, :64]) * both[:, 64:]
            torch.testing.assert_close(avx2.silu_mul(x, gated, 64, gb), want, rtol=1e-6, atol=1e-6)
    gen = torch.Generator().manual_seed(7)
    for n, k, bias in ((1408, 512, True), (70, 200, False), (17, 3, True)):
        weight, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None
        panels = kernel.pack(weight)
        for rows in (1, 2, 3, 4, 14, 15, 32):
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(avx2.product(x, panels, n, b), kernel.product(x, panels, n, b)), (n, k, rows)


def test_without_the_kernel_a_packed_layer_computes_through_onednn(monkeypatch):
    monkeypatch.setattr(linear, "load_row_gemm", lambda: None)
    torch.manual_seed(1)
    stock = torch.nn.Linear(512, 70)
    packed = pack(torch.nn.Linear(512, 70))
    packed.load_state_dict(stock.state_dict())
    x = torch.randn(7, 512)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), stock(x), rtol=1e-5, atol=1e-5)
    assert packed.packed._panels is None  # (no panels made)
