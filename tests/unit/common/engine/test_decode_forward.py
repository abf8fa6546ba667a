"""The decode step's lean forward (:mod:`common.engine.decode_forward`) computes bit for bit what the model's own
forward computes — the hidden states and the KV it writes into the pool — for both families, fp32 and bf16, with
oneDNN-packed linears (fused projections) and with PyTorch's; a decoder it does not know keeps the model's forward."""

from __future__ import annotations

import types

import pytest
import torch

from common.config import ModelConfig
from common.engine.decode import DecodeEngine
from common.engine.decode_forward import DecodeForward
from common.engine.paged_step import build_step_context
from common.kv.native import load_decode_kernel
from common.kv.paged_attention import enable_paged_attention
from common.kv.pool import KVPool
from common.model import linear, row_gemm
from common.model.loader import load_model

LENGTHS = [3, 17, 40, 9, 30]  # (tokens cached per sequence: partial blocks, a block boundary, several blocks)


def _step(lm, forward: DecodeForward | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step over a pool of random KV: the final hidden states and the pool after it."""
    lang = lm.adapter.language_model(lm.model)
    enable_paged_attention(lm.text_config)
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    g = torch.Generator().manual_seed(1)
    pool.keys.copy_(torch.randn(pool.keys.shape, generator=g).to(lm.dtype))
    pool.values.copy_(torch.randn(pool.values.shape, generator=g).to(lm.dtype))
    tables = [[4 * i + j for j in range(4)] for i in range(len(LENGTHS))]
    kernel = load_decode_kernel() if lm.dtype == torch.float32 else None
    ctx = build_step_context(pool, tables, LENGTHS, kernel)
    ids = torch.tensor([[5], [9], [11], [40], [7]])
    positions = lm.adapter.decode_positions(torch.tensor(LENGTHS), torch.tensor([0, 2, -3, 0, 1]))
    with torch.inference_mode():
        if forward is None:
            hidden = lang(input_ids=ids, position_ids=positions, use_cache=False, prism_paged=ctx).last_hidden_state
        else:
            hidden = forward(ids, positions, ctx)
    return hidden, pool.keys, pool.values


@pytest.mark.parametrize("cpu_linear", ["onednn", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["prism-tiny-llava", "prism-tiny-qwen2vl"])
def test_lean_forward_is_the_models_forward_bit_for_bit(model, dtype, cpu_linear, model_cache):
    lm = load_model(ModelConfig(model=model, cache_dir=model_cache, dtype=dtype, cpu_linear=cpu_linear))
    forward = DecodeForward.build(lm.adapter.language_model(lm.model))
    assert forward is not None
    packed = cpu_linear == "onednn" and linear.usable(getattr(torch, dtype))  # (bf16 only where the CPU has it)
    assert (forward.layers[0].qkv is not None) == packed  # (fused only on packed linears)
    kernel = row_gemm.load_row_gemm()
    gated = packed and dtype == "float32" and kernel is not None and kernel.sleef_exp is not None
    assert (forward.layers[0].gated is not None) == gated  # (the MLP's activation in the gate|up product's call)
    fused_mlp = packed and not gated  # (a gated layer keeps no fused gate|up)
    assert (forward.layers[0].gate_up is not None) == fused_mlp
    want, got = _step(lm, None), _step(lm, forward)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_engines_on_one_model_share_its_lean_forward(tiny_llava):
    pool = KVPool(64, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    a, b = DecodeEngine(tiny_llava, pool), DecodeEngine(tiny_llava, pool)
    assert a.forward is not None and a.forward is b.forward
    assert DecodeEngine(tiny_llava, pool, lean_forward=False).forward is None


def test_a_fusion_that_would_round_differently_keeps_the_projections_apart(tiny_llava, monkeypatch):
    from common.engine import decode_forward

    lang = tiny_llava.adapter.language_model(tiny_llava.model)
    assert decode_forward._fusion_is_exact(lang.layers[0])  # (on this machine: fused = separate, bit for bit)
    monkeypatch.setattr(decode_forward, "_fusion_is_exact", lambda layer: False)
    forward = DecodeForward.build(lang)
    assert forward is not None and forward.layers[0].qkv is None and forward.layers[0].gate_up is None


def test_a_gated_product_that_would_round_differently_keeps_pytorchs_activation(tiny_llava, monkeypatch):
    from common.engine import decode_forward

    lang = tiny_llava.adapter.language_model(tiny_llava.model)
    kernel = row_gemm.load_row_gemm()
    if kernel is None or kernel.sleef_exp is None:
        pytest.skip("no gated row product on this CPU (it needs the row kernel and SLEEF's exp in libtorch)")
    assert decode_forward._gating_is_exact(lang.layers[0])
    monkeypatch.setattr(decode_forward.GatedUp, "__call__", lambda self, x: torch.zeros(x.shape[0], 1, self.n))
    assert not decode_forward._gating_is_exact(lang.layers[0])
    monkeypatch.setattr(decode_forward, "_gating_is_exact", lambda layer: False)
    forward = DecodeForward.build(lang)
    assert forward is not None and forward.layers[0].gate_up is not None and forward.layers[0].gated is None


def test_an_unknown_decoder_or_sliding_windows_keep_the_models_forward(tiny_qwen):
    lang = tiny_qwen.adapter.language_model(tiny_qwen.model)
    other = types.SimpleNamespace(**{name: getattr(lang, name) for name in ("embed_tokens", "norm", "rotary_emb")})
    other.config, other.layers = lang.config, [torch.nn.Linear(2, 2)]
    assert DecodeForward.build(other) is None
    other.layers = lang.layers
    other.config = types.SimpleNamespace(**vars(lang.config) | {"use_sliding_window": True})
    assert DecodeForward.build(other) is None
    other.config = lang.config
    assert DecodeForward.build(other) is not None
