"""The decode step's residual adds and RMSNorms in C: PyTorch's bits at the vector width ATen runs at here, checked
before use; every way it can be unavailable leaves PyTorch's ops."""

from __future__ import annotations

import pytest
import torch

from common import native_build
from common.kv.native import norm
from common.native_build import EXACT, compiler, load_library


@pytest.fixture(scope="module")
def library():
    lib, _ = load_library(norm.SOURCE, compiler(), EXACT)
    return lib


@pytest.mark.parametrize("hidden", [512, 1536, 100, 3584, 16])
def test_the_loaded_kernel_is_pytorchs_norm_bit_for_bit(hidden):
    kernel = norm.load_norm_kernel(hidden)
    assert kernel is not None, "a C compiler is on these machines: the kernel must build and agree with PyTorch"
    gen = torch.Generator().manual_seed(hidden + 1)
    for dtype in (torch.float32, torch.bfloat16):
        h = (torch.randn(7, 1, hidden, generator=gen) * 30).to(dtype)
        add = torch.randn(7, 1, hidden, generator=gen).to(dtype)
        weight = torch.rand(hidden, generator=gen).to(dtype)
        total, out = kernel.add_norm(h, add, weight, 1e-5)
        assert torch.equal(total, h + add)
        assert torch.equal(out, norm.torch_rms_norm(weight, 1e-5, h + add))
        same, alone = kernel.add_norm(h, None, weight, 1e-5)
        assert same is h and torch.equal(alone, norm.torch_rms_norm(weight, 1e-5, h))


def test_rows_split_over_threads_give_the_same_bits():
    """The rows are split over PyTorch's threads: 1 or 2 threads, rows that split evenly or not, the same bits."""
    kernel = norm.load_norm_kernel(512)
    gen = torch.Generator().manual_seed(9)
    threads = torch.get_num_threads()
    for rows in (1, 2, 7, 33):
        h, add = torch.randn(rows, 1, 512, generator=gen) * 20, torch.randn(rows, 1, 512, generator=gen)
        weight = torch.rand(512, generator=gen)
        try:
            got = []
            for n in (1, 2):
                torch.set_num_threads(n)
                got.append(kernel.add_norm(h, add, weight, 1e-6))
        finally:
            torch.set_num_threads(threads)
        assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))
        assert torch.equal(got[1][1], norm.torch_rms_norm(weight, 1e-6, h + add))


def test_the_check_tells_summation_orders_apart(library):
    """Only one vector width gives PyTorch's sums here; the others round some rows differently and are refused."""
    agreeing = [lanes for lanes in (2, *norm.LANES) if norm.agrees(norm.NormKernel(library, lanes), 512)]
    assert len(agreeing) == 1 and agreeing[0] in norm.LANES
    assert norm.load_norm_kernel(512).lanes == agreeing[0]


def test_inputs_it_does_not_take_get_pytorchs_ops(library):
    kernel = norm.NormKernel(library, 8)
    h, weight = torch.randn(2, 1, 64, dtype=torch.float64), torch.ones(64, dtype=torch.float64)
    assert not kernel.takes(h, None, weight)
    total, out = kernel.add_norm(h, h, weight, 1e-6)  # (float64: PyTorch's ops, the same answer)
    assert torch.equal(total, h + h) and torch.equal(out, norm.torch_rms_norm(weight, 1e-6, h + h))
    assert not kernel.takes(torch.randn(2, 8), None, torch.ones(4))  # (a weight of another width)
    assert not kernel.takes(torch.randn(4, 8).t(), None, torch.ones(4))  # (not contiguous)


def test_turned_off_or_without_a_compiler_there_is_no_kernel(monkeypatch):
    norm.load_norm_kernel.cache_clear()
    try:
        monkeypatch.setenv("PRISM_NATIVE_NORM", "0")
        assert norm.load_norm_kernel(512) is None
        monkeypatch.delenv("PRISM_NATIVE_NORM")
        monkeypatch.setattr(native_build, "compiler", lambda: None)
        assert norm.load_norm_kernel(512) is None
    finally:
        norm.load_norm_kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forwards_add_and_norm_are_the_same_with_and_without_the_kernel(tiny_llava, monkeypatch, dtype):
    """``DecodeForward._add_norm`` (each residual add with the norm after it), bit for bit, whether it runs in C or
    through PyTorch's ops (the decode step's hidden states against the model's own: tests/unit/common/engine)."""
    from common.engine.decode_forward import DecodeForward

    lang = tiny_llava.adapter.language_model(tiny_llava.model)
    forward = DecodeForward.build(lang)
    assert forward is not None and forward.norms is not None
    x = torch.randn(3, 1, lang.config.hidden_size).to(dtype)
    weight = torch.nn.Module()
    weight.weight, weight.variance_epsilon = lang.norm.weight.detach().to(dtype), lang.norm.variance_epsilon
    with torch.inference_mode():
        native = forward._add_norm(x, x, weight)
        monkeypatch.setattr(forward, "norms", None)
        plain = forward._add_norm(x, x, weight)
    assert all(torch.equal(a, b) for a, b in zip(native, plain, strict=True))
