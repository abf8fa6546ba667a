"""The decoder layers in one foreign call (:mod:`common.engine.decode_layers`) compute what the lean forward's kernels
called from Python compute, bit for bit — the hidden states and the KV written — for both families; a step it does not
take, or a kernel that refuses, runs from Python with the same result."""

from __future__ import annotations

import logging

import pytest
import torch

from common.config import ModelConfig
from common.engine import decode_layers
from common.engine.decode_forward import DecodeForward
from common.engine.paged_step import build_step_context
from common.kv.native import load_decode_kernel
from common.kv.paged_attention import enable_paged_attention
from common.kv.pool import KVPool
from common.model import row_gemm
from common.model.loader import load_model
from common.native_build import address, compiler, load_library

LENGTHS = [3, 17, 40, 9, 30, 16]  # (tokens cached per sequence: partial blocks, block boundaries, several blocks)


def _lean(lm) -> DecodeForward:
    kernel = row_gemm.load_row_gemm()
    if kernel is None or kernel.sleef_exp is None or load_decode_kernel() is None:
        pytest.skip("no row kernel with the gated product, or no attention kernel, here: no chain")
    forward = DecodeForward.build(lm.adapter.language_model(lm.model), lm.model.lm_head)
    assert forward is not None and forward.chain is not None and forward.chain.head is lm.model.lm_head
    return forward


def _step(lm, forward: DecodeForward | None, lengths: list[int], ids=None) -> tuple[torch.Tensor, ...]:
    """One decode step over a pool of random KV: the final hidden states, the logits and the pool after it."""
    lang = lm.adapter.language_model(lm.model)
    enable_paged_attention(lm.text_config)
    pool = KVPool(4 * len(lengths), 16, lm.kv_shape, lm.dtype)
    g = torch.Generator().manual_seed(1)
    pool.keys.copy_(torch.randn(pool.keys.shape, generator=g))
    pool.values.copy_(torch.randn(pool.values.shape, generator=g))
    tables = [[4 * i + j for j in range(4)] for i in range(len(lengths))]
    ctx = build_step_context(pool, tables, lengths, load_decode_kernel())
    ids = torch.randint(0, 50, (len(lengths), 1), generator=g) if ids is None else ids
    positions = lm.adapter.decode_positions(torch.tensor(lengths), torch.randint(-3, 3, (len(lengths),), generator=g))
    keys, values = pool.keys.clone(), pool.values.clone()
    with torch.inference_mode():
        if forward is None:
            hidden = lang(input_ids=ids, position_ids=positions, use_cache=False, prism_paged=ctx).last_hidden_state
            logits = lm.model.lm_head(hidden[:, -1:, :])[:, -1]
        else:
            hidden = forward(ids, positions, ctx)
            pool.keys.copy_(keys), pool.values.copy_(values)  # (the same step again, for its logits)
            logits = forward.logits(
                ids, positions, build_step_context(pool, tables, lengths, ctx.kernel), lm.model.lm_head
            )
    return hidden, logits, pool.keys, pool.values


class _Counted:
    """A chain that records what each of its calls returned (``None``: the step went to Python)."""

    def __init__(self, chain) -> None:
        self.chain, self.results = chain, []

    def __getattr__(self, name: str):
        return getattr(self.chain, name)

    def __call__(self, *args):
        self.results.append(out := self.chain(*args))
        return out


def _counting(forward: DecodeForward) -> list:
    forward.chain = _Counted(forward.chain)  # type: ignore[assignment]
    return forward.chain.results


@pytest.mark.parametrize("model", ["prism-tiny-llava", "prism-tiny-qwen2vl"])
def test_the_chain_gives_the_kernels_called_from_python_bit_for_bit(model, model_cache):
    lm = load_model(ModelConfig(model=model, cache_dir=model_cache, dtype="float32"))
    forward = _lean(lm)
    chain = forward.chain
    results = _counting(forward)
    got = _step(lm, forward, LENGTHS)
    assert len(results) == 2 and all(r is not None and r[1] is not None for r in results)  # (the chain took both)
    forward.chain = None
    python = _step(lm, forward, LENGTHS)
    model_own = _step(lm, None, LENGTHS)
    for a, b, c in zip(got, python, model_own, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    forward.chain = chain
    one = _step(lm, forward, LENGTHS[:1])  # (one row: a sequence decoded alone)
    assert torch.equal(one[0], _step(lm, None, LENGTHS[:1])[0])


def test_a_batch_of_the_row_kernels_most_rows_is_the_models_forward(tiny_qwen):
    forward = _lean(tiny_qwen)
    results = _counting(forward)
    lengths = [3 + (7 * i) % 60 for i in range(row_gemm.MAX_ROWS)]
    got = _step(tiny_qwen, forward, lengths)
    assert len(results) == 2 and all(r is not None for r in results)
    for a, b in zip(got, _step(tiny_qwen, None, lengths), strict=True):
        assert torch.equal(a, b)


def test_a_pool_of_fewer_layers_than_the_model_is_refused(tiny_llava):
    forward = _lean(tiny_llava)
    # (a pool of one layer: the model's second would be written past it)
    pool = KVPool(8, 16, (1, *tiny_llava.kv_shape[1:]), tiny_llava.dtype)
    ctx = build_step_context(pool, [[0]], [3], load_decode_kernel())
    cos = sin = torch.zeros(1, 1, forward.head_dim)
    assert forward.chain(torch.tensor([[1]]), cos, sin, ctx) is None


def test_a_batch_over_the_row_kernels_rows_runs_from_python(tiny_llava):
    forward = _lean(tiny_llava)
    results = _counting(forward)
    lengths = [5 + i for i in range(row_gemm.MAX_ROWS + 1)]
    got = _step(tiny_llava, forward, lengths)
    assert results == [None, None]
    for a, b in zip(got, _step(tiny_llava, None, lengths), strict=True):
        assert torch.equal(a, b)


def test_a_kernel_that_refuses_hands_the_step_back_to_python(tiny_llava, caplog):
    forward = _lean(tiny_llava)
    # A gated GEMM that returns 1 without reading its arguments (the row kernel's row_gemm_fast_path, where it runs):
    # the first layer's gate|up refuses, after the layer's attention wrote its KV rows.
    library, _ = load_library(row_gemm.SOURCE, compiler(), row_gemm.EXACT)
    assert library.row_gemm_fast_path() == 1
    forward.chain._base.gated = address(library.row_gemm_fast_path)
    results = _counting(forward)
    with caplog.at_level(logging.WARNING, logger=decode_layers.__name__):
        got = _step(tiny_llava, forward, LENGTHS)
    assert results == [None, None]
    assert "layer 0's gate_up kernel refused" in caplog.text
    for a, b in zip(got, _step(tiny_llava, None, LENGTHS), strict=True):
        assert torch.equal(a, b)


def test_a_token_outside_the_table_is_refused_before_any_layer_and_raises_as_pytorch_does(tiny_llava, caplog):
    forward = _lean(tiny_llava)
    results = _counting(forward)
    vocab = tiny_llava.adapter.language_model(tiny_llava.model).embed_tokens.num_embeddings
    ids = torch.tensor([[1], [vocab], [2], [3], [4], [5]])
    with caplog.at_level(logging.WARNING, logger=decode_layers.__name__), pytest.raises(IndexError):
        _step(tiny_llava, forward, LENGTHS, ids)
    assert results == [None]
    assert "a token id outside the table" in caplog.text


def test_turned_off_or_in_bf16_there_is_no_chain(tiny_llava, model_cache, monkeypatch):
    _lean(tiny_llava)  # (skips where the kernels do not run)
    lm = load_model(ModelConfig(model="prism-tiny-llava", cache_dir=model_cache, dtype="bfloat16"))
    forward = DecodeForward.build(lm.adapter.language_model(lm.model))
    assert forward is not None and forward.chain is None
    monkeypatch.setenv("PRISM_NATIVE_LAYERS", "0")
    forward = DecodeForward.build(tiny_llava.adapter.language_model(tiny_llava.model))
    assert forward is not None and forward.chain is None
