"""The native CPU decode-attention kernel: the same attention as PyTorch's SDPA over any block table, its build
cache, and every way it can be unavailable (the engine then keeps PyTorch's path, with the same tokens)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from common.engine.decode import DecodeEngine
from common.kv import native
from common.kv.native import load_decode_kernel
from common.kv.pool import KVPool
from common.reference.decode import decode
from tests.unit.common.engine.test_decode_engine import _mixed_requests, _run


def _reference(query, keys, values, tables, lengths, scale):
    """PyTorch's SDPA, sequence by sequence, over each table's tokens gathered from the pool layer."""
    block_size = keys.shape[1]
    out = torch.empty_like(query)
    for i, n in enumerate(lengths.tolist()):
        blocks = tables[i, : -(-n // block_size)]
        k = keys[blocks].reshape(-1, *keys.shape[2:])[:n].transpose(0, 1)[None]
        v = values[blocks].reshape(-1, *values.shape[2:])[:n].transpose(0, 1)[None]
        out[i : i + 1] = torch.nn.functional.scaled_dot_product_attention(
            query[i : i + 1], k, v, scale=scale, enable_gqa=query.shape[1] != keys.shape[2]
        )
    return out


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "block_size"),
    [
        (8, 4, 64, 16),
        (4, 4, 128, 16),
        (16, 2, 64, 5),
        (8, 2, 128, 7),
        (16, 2, 128, 16),
        (6, 2, 64, 16),
        (12, 2, 128, 3),
        (7, 1, 64, 16),
        (6, 2, 40, 5),
        (2, 1, 16, 1),
        (18, 2, 64, 16),
        (1, 1, 64, 4),
        (2, 1, 128, 16),
        (2, 2, 64, 3),
        (24, 4, 64, 16),
    ],
    # (the AVX-512 path takes head sizes 64 and 128 with 1 to 8 query heads per KV head: up to 16 query heads, the
    # row-order loops (1, 2, 4, 8 and 16 heads: 16 / heads tokens to a reduction; 6, 7, 12: reductions across tokens),
    # above 16 (24 here) the loops over a block head by head, their 16-token tiles across blocks of any size and their
    # value sums in passes of a few heads; the others — head size 40 or 16, 9 heads per KV head — the portable loops)
    ids=[
        "gqa2-d64",
        "mha-d128",
        "gqa8-d64-bs5",
        "gqa4-d128-bs7",
        "gqa8-d128",
        "gqa3-d64",
        "gqa6-d128-bs3",
        "gqa7-d64",
        "gqa3-d40",
        "mqa-d16-bs1",
        "gqa9-d64",
        "one-head-d64-bs4",
        "gqa2-d128-two-heads",
        "mha-two-heads-bs3",
        "gqa6-d64-24-heads",
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_is_sdpa_over_any_block_table(q_heads, kv_heads, dim, block_size, threads):
    kernel = load_decode_kernel()
    assert kernel is not None, "a C compiler is on these machines: the kernel must build"
    gen = torch.Generator().manual_seed(q_heads * dim + block_size)
    blocks = 160
    keys = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    values = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    lengths = torch.tensor([1, block_size, block_size + 1, 37, 150, 2, 90][: 7 if block_size > 1 else 5])
    rng = random.Random(dim)
    width = max(-(-n // block_size) for n in lengths.tolist())
    order = list(range(blocks))
    rng.shuffle(order)  # scattered tables, blocks in any order, some sequences sharing blocks
    tables = torch.tensor([[order[(7 * i + j) % blocks] for j in range(width)] for i in range(len(lengths))])
    query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen)
    scale = 0.37
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.attend(query, keys, values, tables, lengths, scale)
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.shape == query.shape
    torch.testing.assert_close(got, _reference(query, keys, values, tables, lengths, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "block_size"),
    [(8, 4, 64, 16), (8, 2, 128, 7), (16, 2, 128, 16), (6, 2, 64, 5), (6, 2, 40, 5)],
)
def test_bf16_kernel_rounds_where_pytorchs_bf16_attention_does(q_heads, kv_heads, dim, block_size):
    """In bf16 the kernel widens its inputs and sums in fp32, rounds each exp to bf16 before it weights the values
    and divides by the fp32 sum after (the order of PyTorch's CPU flash attention): that computation done in torch
    to within one bf16 step, and close to PyTorch's own bf16 SDPA."""
    kernel = load_decode_kernel()
    gen = torch.Generator().manual_seed(dim)
    keys = torch.randn(64, block_size, kv_heads, dim, generator=gen).bfloat16()
    values = torch.randn(64, block_size, kv_heads, dim, generator=gen).bfloat16()
    lengths = torch.tensor([1, block_size + 1, 37, 150])
    width = max(-(-n // block_size) for n in lengths.tolist())
    tables = torch.tensor([[(11 * i + 5 * j) % 64 for j in range(width)] for i in range(len(lengths))])
    query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen).bfloat16()
    got = kernel.attend(query, keys, values, tables, lengths, 0.3)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == query.shape
    group = q_heads // kv_heads
    for i, n in enumerate(lengths.tolist()):
        blocks = tables[i, : -(-n // block_size)]
        k = keys[blocks].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(group, 1)  # [n, q_heads, dim]
        v = values[blocks].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", query[i, :, 0].float(), k) * 0.3
        exps = torch.exp(scores - scores.amax(-1, keepdim=True))
        want = torch.einsum("hn,nhd->hd", exps.bfloat16().float(), v) / exps.sum(-1, keepdim=True)
        torch.testing.assert_close(got[i, :, 0].float(), want.bfloat16().float(), rtol=8e-3, atol=8e-3)
    pytorch = _reference(query, keys, values, tables, lengths, 0.3)
    torch.testing.assert_close(got.float(), pytorch.float(), rtol=2e-2, atol=2e-2)


ROW_SHAPES = [(8, 4, 64), (8, 2, 128), (16, 2, 64), (4, 4, 128), (2, 1, 64), (6, 2, 64), (12, 2, 128), (7, 7, 64)]


@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), ROW_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_order_gives_the_head_order_loops_bits(q_heads, kv_heads, dim, dtype):
    """The loops that read each key and value row whole (query heads dividing 16; and fewer than 16, a reduction's 16
    pairs then spanning tokens) add the same terms in the same order as the loops that read a block head by head (the
    build with ``-DROW_ORDER=0``): the same bits, fp32 and bf16, over scattered tables with partial blocks and
    sequences shorter than one 16-pair reduction."""
    kernel = load_decode_kernel()
    if not kernel.fast_path:
        pytest.skip("no AVX-512 here: both builds run the portable loops")
    from common.native_build import COMPILE, compiler, load_library

    head_order = native.DecodeKernel(*load_library(native.SOURCE, compiler(), (*COMPILE, "-DROW_ORDER=0")))
    gen = torch.Generator().manual_seed(q_heads + dim)
    block_size, blocks = 16, 96
    keys = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    lengths = torch.tensor([1, 3, 16, 17, 150, 301])
    width = max(-(-n // block_size) for n in lengths.tolist())
    tables = torch.tensor([[(13 * i + 7 * j) % blocks for j in range(width)] for i in range(len(lengths))])
    query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen).to(dtype)
    got = kernel.attend(query, keys, values, tables, lengths, 0.125)
    want = head_order.attend(query, keys, values, tables, lengths, 0.125)
    assert got is not None and want is not None and torch.equal(got, want)


def test_the_avx512_path_is_built_where_the_cpu_has_it():
    """A CPU with AVX-512F (these machines) builds the fast loops, so the shapes above test them; elsewhere only the
    portable loops exist, and the same cases test those."""
    kernel = load_decode_kernel()
    assert kernel is not None
    flags = next(line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")).split()
    assert kernel.fast_path == ("avx512f" in flags)


def test_more_threads_than_sequences_still_attend_every_sequence_once():
    kernel = load_decode_kernel()
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(8, 4, 2, 16, generator=gen), torch.randn(8, 4, 2, 16, generator=gen)
    tables, lengths = torch.tensor([[3, 1], [0, 6]]), torch.tensor([7, 5])
    query = torch.randn(2, 4, 1, 16, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        got = kernel.attend(query, keys, values, tables, lengths, 0.25)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, _reference(query, keys, values, tables, lengths, 0.25), rtol=1e-5, atol=1e-5)


def test_inputs_the_kernel_does_not_take_are_left_to_pytorch():
    kernel = load_decode_kernel()
    keys, tables, lengths = torch.randn(4, 16, 2, 8), torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    query = torch.randn(1, 4, 1, 8)
    assert kernel.attend(query, keys, keys, tables, lengths, 1.0) is not None
    strided = torch.randn(4, 32, 2, 8)[:, ::2]
    assert kernel.attend(query, strided, strided, tables, lengths, 1.0) is None  # not a contiguous pool layer
    assert kernel.attend(torch.randn(1, 3, 1, 8), keys, keys, tables, lengths, 1.0) is None  # 3 heads over 2
    assert kernel.attend(query.double(), keys.double(), keys.double(), tables, lengths, 1.0) is None
    assert kernel.attend(query.half(), keys.half(), keys.half(), tables, lengths, 1.0) is None
    assert kernel.attend(query.bfloat16(), keys, keys, tables, lengths, 1.0) is None  # (one dtype for all three)
    assert kernel.attend(query, keys, keys, tables.int(), lengths, 1.0) is None


def test_loading_the_kernel_leaves_the_floating_point_mode_alone(tmp_path, monkeypatch):
    """GCC < 13 links a ``-ffast-math`` shared library against crtfastmath.o, whose constructor turns on
    flush-to-zero in the loading thread; the kernel is linked without it, so denormals stay denormals."""
    monkeypatch.setenv("PRISM_NATIVE_CACHE", str(tmp_path))  # a fresh build, loaded (and its constructors run) here
    assert native.load_decode_kernel.__wrapped__() is not None
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a denormal float32
    assert (tiny * 2).item() > 0 and (tiny / 2).item() > 0


def test_build_is_cached_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_NATIVE_CACHE", str(tmp_path))
    first = native.load_decode_kernel.__wrapped__()
    assert first is not None and first.path.parent == tmp_path
    built = first.path.stat().st_mtime_ns
    again = native.load_decode_kernel.__wrapped__()
    assert again.path == first.path and again.path.stat().st_mtime_ns == built  # loaded, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no partial file left behind


def test_a_header_beside_a_source_is_part_of_its_cache_key(tmp_path):
    """``bf16.h`` is included by both C sources: changing it must rebuild them, not load a stale library."""
    from common.native_build import _digest

    source = tmp_path / "k.c"
    source.write_text('#include "h.h"\n')
    (tmp_path / "h.h").write_text("#define A 1\n")
    before = _digest(source)
    (tmp_path / "h.h").write_text("#define A 2\n")
    assert _digest(source) != before


@pytest.mark.parametrize(
    ("env", "message"),
    [({"PRISM_NATIVE_ATTENTION": "0"}, "turned off"), ({"CC": "/bin/false"}, "unavailable")],
    ids=["turned-off", "compiler-fails"],
)
def test_without_the_kernel_the_loader_says_why_and_returns_none(tmp_path, monkeypatch, caplog, env, message):
    monkeypatch.setenv("PRISM_NATIVE_CACHE", str(tmp_path / "fresh"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.INFO, logger="prism.native"):  # (common.native_build.load_optional says why)
        assert native.load_decode_kernel.__wrapped__() is None
    assert message in caplog.text


def test_engine_uses_the_kernel_for_fp32_and_bf16_pools(tiny_llava, model_cache):
    from tests.conftest import _load

    lm = tiny_llava
    assert DecodeEngine(lm, KVPool(8, 16, lm.kv_shape, lm.dtype)).kernel is not None
    assert DecodeEngine(lm, KVPool(8, 16, lm.kv_shape, lm.dtype), native_attention=False).kernel is None
    bf16 = _load("prism-tiny-llava", model_cache, dtype="bfloat16")
    assert DecodeEngine(bf16, KVPool(8, 16, bf16.kv_shape, bf16.dtype)).kernel is not None
    fp16 = _load("prism-tiny-llava", model_cache, dtype="float16")
    assert DecodeEngine(fp16, KVPool(8, 16, fp16.kv_shape, fp16.dtype)).kernel is None


def test_bf16_engine_batched_equals_alone(model_cache):
    """bf16 on the kernel: a batch of mixed requests gives each the tokens it gets decoded alone (the packed GEMMs
    and the kernel both compute a row independently of the others)."""
    from tests.conftest import _load

    lm = _load("prism-tiny-llava", model_cache, dtype="bfloat16")
    requests = _mixed_requests(lm, 6)
    batched = _run(DecodeEngine(lm, KVPool(512, 16, lm.kv_shape, lm.dtype), max_batch=8), requests)
    for rid, pre, sampling in requests:
        alone = _run(DecodeEngine(lm, KVPool(512, 16, lm.kv_shape, lm.dtype), max_batch=1), [(rid, pre, sampling)])
        assert batched[rid] == alone[rid], rid


def test_a_step_the_kernel_cannot_run_takes_pytorchs_path_with_the_same_tokens(tiny_qwen, monkeypatch):
    lm = tiny_qwen
    requests = _mixed_requests(lm, 6)
    alone = {rid: list(decode(lm, pre, sp).token_ids) for rid, pre, sp in requests}
    engine = DecodeEngine(lm, KVPool(256, 16, lm.kv_shape, lm.dtype))
    calls = []

    def no_scratch(*args):
        calls.append(1)
        return None  # what attend returns when the kernel could not have its scratch memory

    monkeypatch.setattr(engine.kernel, "attend", no_scratch)
    monkeypatch.setattr(engine.kernel, "rope_attend", no_scratch)  # (the lean forward's call, before attend)
    if engine.forward is not None:  # (the layers' driver calls the kernel from C: its refusals are tested on their own)
        monkeypatch.setattr(engine.forward, "chain", None)
    assert _run(engine, requests) == alone
    assert calls, "the fallback must have been taken"
    engine.pool.check_no_leaks()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim", "block_size"), [(8, 4, 64, 16), (12, 2, 128, 5), (6, 2, 40, 3)])
def test_rope_attend_is_the_rotation_the_kv_write_and_the_attention_pytorch_does(
    q_heads, kv_heads, dim, block_size, dtype
):
    """The lean forward's one call per layer (:meth:`DecodeKernel.rope_attend`) against what it replaces: the rotation
    as transformers computes it (``decode_forward.rotate``), the new rows written into the pool by indexing, and the
    kernel's attention over the rotated query — the same output and the same pool, bit for bit."""
    from common.kv.native import torch_rotate as rotate

    kernel = load_decode_kernel()
    gen = torch.Generator().manual_seed(dim + block_size)
    lengths = torch.tensor([1, block_size, block_size + 1, 37, 90])  # (each sequence's new token included)
    batch, width = len(lengths), -(-90 // block_size)
    blocks = batch * width + 8
    keys = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width)
    qkv = (3 * torch.randn(batch, 1, (q_heads + 2 * kv_heads) * dim, generator=gen)).to(dtype)
    angles = torch.rand(batch, 1, dim, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    mine_k, mine_v = keys.clone(), values.clone()
    out = kernel.rope_attend(qkv, cos, sin, mine_k, mine_v, tables, lengths, 0.125, q_heads)

    heads = qkv.view(batch, 1, q_heads + 2 * kv_heads, dim).transpose(1, 2)
    rotated = rotate(heads[:, : q_heads + kv_heads], cos.unsqueeze(1), sin.unsqueeze(1))
    t = lengths - 1
    slots = tables[torch.arange(batch), t // block_size], t % block_size
    keys[slots] = rotated[:, q_heads:, 0]
    values[slots] = heads[:, q_heads + kv_heads :, 0]
    expected = kernel.attend(rotated[:, :q_heads], keys, values, tables, lengths, 0.125)
    assert out is not None and out.shape == (batch, 1, q_heads * dim)
    assert torch.equal(mine_k, keys) and torch.equal(mine_v, values)
    assert torch.equal(out, expected.transpose(1, 2).reshape(batch, 1, -1))


def test_rope_attend_leaves_inputs_it_does_not_take_to_pytorch():
    kernel = load_decode_kernel()
    keys = torch.zeros(8, 16, 2, 64)
    qkv, trig = torch.zeros(2, 1, 8 * 64), torch.zeros(2, 1, 64)
    tables, lengths = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    assert kernel.rope_attend(qkv, trig, trig, keys, keys.clone(), tables, lengths, 1.0, 4) is not None
    assert kernel.rope_attend(qkv.double(), trig, trig, keys, keys.clone(), tables, lengths, 1.0, 4) is None  # dtype
    assert kernel.rope_attend(qkv, trig[:, :, :32], trig, keys, keys.clone(), tables, lengths, 1.0, 4) is None  # cos
    assert kernel.rope_attend(qkv, trig, trig, keys, keys.clone(), tables, lengths, 1.0, 6) is None  # projection size
    empty = torch.tensor([0, 1])  # (a sequence of no tokens has no slot to write: the C call refuses it)
    assert kernel.rope_attend(qkv, trig, trig, keys, keys.clone(), tables, empty, 1.0, 4) is None
    none = torch.zeros(8, 16, 0, 64)
    assert kernel.rope_attend(torch.zeros(2, 1, 4 * 64), trig, trig, none, none, tables, lengths, 1.0, 4) is None
    odd = torch.zeros(8, 16, 2, 63)
    assert (
        kernel.rope_attend(torch.zeros(2, 1, 8 * 63), trig[..., :63], trig[..., :63], odd, odd, tables, lengths, 1.0, 4)
        is None
    )


def test_the_rotation_is_checked_against_pytorch_before_the_engine_uses_it(monkeypatch):
    """Bit-exactness depends on the compiler (fused multiply-adds would round differently): the loader checks it once
    and, where it fails, ``rope_attend`` declines and the engine rotates with PyTorch's ops."""
    kernel = load_decode_kernel()
    assert kernel.rope_exact and native.rope_agrees(kernel)
    monkeypatch.setattr(native, "torch_rotate", lambda x, cos, sin: (x * cos) + (x * sin))  # (another rotation)
    assert not native.rope_agrees(kernel)
    monkeypatch.setattr(kernel, "rope_exact", False)
    trig = torch.zeros(2, 1, 64)
    keys, tables, lengths = (
        torch.zeros(8, 16, 2, 64),
        torch.zeros(2, 1, dtype=torch.long),
        torch.ones(2, dtype=torch.long),
    )
    assert (
        kernel.rope_attend(torch.zeros(2, 1, 8 * 64), trig, trig, keys, keys.clone(), tables, lengths, 1.0, 4) is None
    )
