"""Continuous-batching decode over the paged pool: batched equals alone, leases queue and never leak."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.decode import DecodeEngine
from common.kv.pool import KVPool, LeaseTooLarge
from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.stages.decode import decode
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.prefill import prefill
from common.stages.process import process_images
from common.stages.prompt import build_prompt


def _prefilled(lm, i: int, n_images: int, sampling: SamplingParams):
    images = [synthetic_image(90 + 40 * j, 70 + 15 * i, seed=100 * i + j) for j in range(n_images)]
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": f"Request {i}: what is shown?"}]
    media = process_images(lm, images)
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    return prefill(lm, merge(lm, prompt, encode_media(lm, media)), sampling, 16)


def _mixed_requests(lm, n: int = 16):
    out = []
    for i in range(n):
        sampling = SamplingParams(max_tokens=6 + i, ignore_eos=i % 2 == 0)
        if i % 4 == 3:
            sampling = sampling.model_copy(update={"temperature": 0.8, "top_p": 0.9, "seed": i})
        out.append((f"req-{i}", _prefilled(lm, i, (0, 1, 3)[i % 3], sampling), sampling))
    return out


def _run(engine: DecodeEngine, requests, arrive_every: int = 1) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    queue = list(requests)
    steps = 0
    while queue or engine.has_work():
        if queue and steps % arrive_every == 0:
            engine.submit(*queue.pop(0))
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
        steps += 1
        assert steps < 10_000
    return tokens


def test_continuous_batching_equals_each_request_alone(tiny_model):
    lm = tiny_model
    requests = _mixed_requests(lm)
    alone = {rid: list(decode(lm, pre, sp).token_ids) for rid, pre, sp in requests}
    pool = KVPool(256, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=32)
    batched = _run(engine, requests, arrive_every=2)  # staggered: sequences join while others run
    assert batched == alone
    assert max(len(t) for t in batched.values()) > 12
    pool.check_no_leaks()


def test_batch_limit_rotates_and_still_matches(tiny_llava):
    requests = _mixed_requests(tiny_llava, 8)
    alone = {rid: list(decode(tiny_llava, pre, sp).token_ids) for rid, pre, sp in requests}
    pool = KVPool(256, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    assert _run(DecodeEngine(tiny_llava, pool, max_batch=3), requests) == alone
    pool.check_no_leaks()


def test_small_pool_queues_leases_and_finishes_everything(tiny_llava):
    """Far more demand than blocks: leases wait in FIFO order, nobody crashes or starves, all tokens identical."""
    requests = _mixed_requests(tiny_llava, 10)
    alone = {rid: list(decode(tiny_llava, pre, sp).token_ids) for rid, pre, sp in requests}
    need = max(-(-(pre.kv.num_tokens + sp.max_tokens) // 16) for _, pre, sp in requests)
    pool = KVPool(need * 2, 16, tiny_llava.kv_shape, tiny_llava.dtype, max_lease_fraction=0.5)
    engine = DecodeEngine(tiny_llava, pool)
    for r in requests:
        engine.submit(*r)
    assert engine.num_waiting > 0, "the pool is small enough that some leases must wait"
    tokens = {rid: [] for rid, _, _ in requests}
    while engine.has_work() or engine.num_waiting:
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
    assert tokens == alone
    pool.check_no_leaks()


def test_request_larger_than_its_lease_is_refused(tiny_llava):
    pool = KVPool(20, 16, tiny_llava.kv_shape, tiny_llava.dtype, max_lease_fraction=0.5)
    engine = DecodeEngine(tiny_llava, pool)
    sampling = SamplingParams(max_tokens=200)
    pre = _prefilled(tiny_llava, 0, 1, sampling)
    with pytest.raises(LeaseTooLarge) as info:
        engine.submit("big", pre, sampling)
    err = info.value
    assert err.http_status == 400 and err.code == "kv_lease_exceeded"
    assert "per-request limit is 10 blocks (160 tokens)" in err.message
    assert engine.num_waiting == 0 and engine.num_running == 0
    pool.check_no_leaks()


def test_pool_is_empty_after_a_storm_of_cancellations(tiny_qwen):
    lm = tiny_qwen
    rng = random.Random(7)
    requests = [
        (f"c{i}", _prefilled(lm, i, i % 3, SamplingParams(max_tokens=30, ignore_eos=True)), None) for i in range(24)
    ]
    pool = KVPool(60, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=8)
    live: list[str] = []
    for rid, pre, _ in requests:
        engine.submit(rid, pre, SamplingParams(max_tokens=30, ignore_eos=True))
        live.append(rid)
        engine.step()
        if rng.random() < 0.6:  # cancel someone: running, waiting or already finished
            victim = live.pop(rng.randrange(len(live)))
            engine.cancel(victim)
            assert not engine.cancel(victim), "a second cancel is a no-op"
    for rid in live[::2]:
        engine.cancel(rid)
    while engine.has_work() or engine.num_waiting:
        engine.step()
    pool.check_no_leaks()


def test_pool_lease_accounting_unit():
    pool = KVPool(10, 4, (1, 1, 2), torch.float32, max_lease_fraction=0.6)
    a = pool.request_lease("a", 6)
    assert a is not None and pool.request_lease("b", 5) is None and pool.request_lease("c", 1) is None
    assert pool.is_waiting("c"), "FIFO: c must not overtake b"
    blocks = pool.allocate(a, 2)
    pool.ref(blocks[:1])  # e.g. the prefix cache keeps the first block
    assert pool.release("a") == ["b", "c"]
    assert pool.refcount(blocks[0]) == 1 and pool.used_blocks == 1
    pool.release("b")
    pool.release("c")
    pool.unref(blocks[:1])
    pool.check_no_leaks()
    with pytest.raises(RuntimeError, match="twice"):
        pool.unref(blocks[:1])
