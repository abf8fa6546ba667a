"""Packed linear layers (:mod:`common.model.linear`): the products of PyTorch's ``F.linear`` to rounding, the same
row whatever the batch (up to 32 rows), packed at load by default and not with ``cpu_linear: torch``."""

from __future__ import annotations

import pytest
import torch

from common.config import ModelConfig
from common.model import linear
from common.model.linear import PackedLinear, pack, pack_linears

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch has no oneDNN packed linear")


def _layer(n_in: int, n_out: int, bias: bool, dtype=torch.float32) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(n_in + n_out)
    stock = torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)
    packed = torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)
    packed.load_state_dict(stock.state_dict())
    return stock, pack(packed)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_equals_f_linear_to_rounding(rows, bias):
    stock, packed = _layer(512, 1408, bias)
    x = torch.randn(rows, 512)
    with torch.inference_mode():
        assert isinstance(packed, PackedLinear) and packed.weight.shape == (1408, 512)
        torch.testing.assert_close(packed(x), stock(x), rtol=1e-5, atol=1e-5)
        assert packed(x[:, None, :]).shape == (rows, 1, 1408)  # (any leading dims, as F.linear)


def test_non_contiguous_inputs_give_the_right_products():
    """oneDNN reads a 2-D input with transposed strides as row-major (wrong products without the layer's
    ``contiguous``); strided and permuted views of every rank give F.linear's products."""
    stock, packed = _layer(64, 48, True)
    inputs = [
        torch.randn(64, 5).t(),
        torch.randn(2, 6, 64)[:, ::2],
        torch.randn(3, 64, 2)[..., 0],
        torch.randn(64, 3, 2).permute(2, 1, 0),
    ]
    with torch.inference_mode():
        for x in inputs:
            assert not x.is_contiguous()
            torch.testing.assert_close(packed(x), stock(x), rtol=1e-5, atol=1e-5)
        assert packed(torch.randn(0, 64)).shape == (0, 48)


def test_a_row_gets_the_same_product_in_any_batch():
    """What lets a batched decode step compute exactly what the sequence alone would: a row's product does not
    depend on how many rows share the call (PyTorch's fp32 path on MKL rounds row 0 of 32 differently from a
    1-row call on these machines — not asserted: it is MKL's, not ours)."""
    _, packed = _layer(512, 1408, False)
    x = torch.randn(32, 512)
    with torch.inference_mode():
        full = packed(x)
        for n in (1, 5, 8, 17, 31):
            assert torch.equal(packed(x[:n]), full[:n])


BF16 = linear.usable(torch.bfloat16)
"""Whether this CPU has oneDNN's bf16 packed product (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only EPYC has not)."""


@pytest.mark.skipif(not BF16, reason="no bf16 packed product on this CPU (the next test covers that case)")
def test_bf16_packs_too():
    stock, packed = _layer(256, 128, True, torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), stock(x).float(), rtol=2e-2, atol=2e-2)


def test_a_dtype_without_a_packed_product_here_keeps_pytorchs_linear(monkeypatch, caplog):
    """The check's refusal (oneDNN raising for a CPU without the dtype's kernel, as bf16 does on AVX2) is a warning,
    and such layers stay plain — at load and when a packed layer is cast to that dtype."""

    def no_bf16(weight, hint):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq")
        return real(weight, hint)

    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(linear, "_reorder", no_bf16)
    assert not linear._works(torch.bfloat16) and linear._works(torch.float32)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "avx512bw" in caplog.text
    monkeypatch.setattr(linear, "usable", lambda dtype: dtype == torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).bfloat16())
    assert pack_linears(model) == 1 and [type(m) for m in model] == [PackedLinear, torch.nn.Linear]
    stock, packed = _layer(64, 48, True)
    packed.to(torch.bfloat16)
    assert type(packed) is torch.nn.Linear and not hasattr(packed, "packed")
    x = torch.randn(4, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x.bfloat16()).float(), stock(x), rtol=3e-2, atol=3e-2)


def test_only_cpu_linears_of_a_packed_dtype_are_packed():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.Linear(8, 8).half(),
        torch.nn.Conv1d(2, 2, 1),
        torch.nn.Embedding(4, 8),
    )
    assert pack_linears(model) == 1
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "Conv1d", "Embedding"]
    assert pack_linears(torch.nn.Sequential()) == 0
    assert set(model[0].state_dict()) == {"weight", "bias"}  # (the packed copy is no parameter or buffer)


def test_a_machine_whose_packed_op_fails_keeps_pytorchs_path(monkeypatch):
    monkeypatch.setattr(linear, "usable", lambda dtype: False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert pack_linears(model) == 0
    assert type(model[0]) is torch.nn.Linear


def test_the_loader_packs_by_default_and_not_when_told(tiny_llava, reference_llava):
    """``tiny_llava`` is loaded as the stages load it; ``reference_llava`` with ``cpu_linear: torch``."""
    assert ModelConfig().cpu_linear == "onednn"
    lang = tiny_llava.adapter.language_model(tiny_llava.model)
    packed = [m for m in tiny_llava.model.modules() if isinstance(m, PackedLinear)]
    assert tiny_llava.model.lm_head in packed and all(
        isinstance(m, PackedLinear) for m in lang.layers[0].mlp.children() if isinstance(m, torch.nn.Linear)
    )
    assert not any(isinstance(m, PackedLinear) for m in reference_llava.model.modules())
    ids = torch.tensor([[1, 5, 9, 12, 40]])
    with torch.inference_mode():
        a = tiny_llava.model(input_ids=ids).logits
        b = reference_llava.model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_packed_layer_follows_its_weight_when_moved_cast_or_loaded():
    _, packed = _layer(64, 48, True)
    x = torch.randn(4, 64)
    other = torch.nn.Linear(64, 48)
    packed.load_state_dict(other.state_dict())
    assert type(packed) is PackedLinear
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), other(x), rtol=1e-5, atol=1e-5)  # (the new weights, not the old)
    packed.to(torch.bfloat16)  # (packed again where bf16 has a packed product here, else plain: the test above)
    assert (type(packed) is PackedLinear and packed.packed.dtype == torch.bfloat16) == BF16
    with torch.inference_mode():
        torch.testing.assert_close(packed(x.bfloat16()).float(), other(x), rtol=3e-2, atol=3e-2)
    if BF16:
        packed.float()  # (back to fp32: packed as fp32)
        assert type(packed) is PackedLinear and packed.packed.dtype == torch.float32
    _, packed = _layer(64, 48, True)
    packed.half()  # (no packed fp16 path: a plain linear again)
    assert type(packed) is torch.nn.Linear and not hasattr(packed, "packed")


def test_autograd_and_a_mismatched_dtype_take_f_linear():
    """oneDNN's op records no gradient and does not check dtypes: those calls go to ``F.linear``, which does."""
    _, packed = _layer(64, 48, True)
    x = torch.randn(4, 64, requires_grad=True)
    packed(x).sum().backward()
    assert packed.weight.grad is not None and x.grad is not None
    with pytest.raises(RuntimeError):
        packed(torch.randn(4, 64, dtype=torch.float64))


def test_loaded_models_record_no_gradients(tiny_llava):
    assert not any(p.requires_grad for p in tiny_llava.model.parameters())
