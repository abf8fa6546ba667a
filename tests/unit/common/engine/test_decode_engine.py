"""Continuous-batching decode over the paged pool: batched equals alone, leases queue and never leak."""

from __future__ import annotations

import random
import time

import pytest
import torch

from common.engine.decode import DecodeEngine
from common.kv.landing import Landing
from common.kv.paged_attention import is_run
from common.kv.pool import KVPool, LeaseTooLarge
from common.kv.transport import make_transport
from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
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
        if i % 4 == 1:  # penalties: per-sequence token counts must follow each sequence through the batch
            update = {"frequency_penalty": 0.9, "presence_penalty": 0.4} if i % 8 == 1 else {"presence_penalty": -1.5}
            sampling = sampling.model_copy(update=update)
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


@pytest.mark.parametrize(
    ("contiguous", "native"),
    [(True, True), (False, True), (True, False), (False, False)],
    ids=["native-runs", "native-scattered", "torch-views", "torch-gathered"],
)
def test_continuous_batching_equals_each_request_alone(tiny_model, contiguous, native):
    lm = tiny_model
    requests = _mixed_requests(lm)
    alone = {rid: list(decode(lm, pre, sp).token_ids) for rid, pre, sp in requests}
    pool = KVPool(256, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=32, prefer_contiguous=contiguous, native_attention=native)
    assert (engine.kernel is not None) == native  # (the native kernel builds on these machines: a C compiler is here)
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


def test_most_tokens_left_follows_the_longest_running_sequence(tiny_llava):
    """What a replica's ``stats`` reports as how long its busiest stream may still go on (the multi-node test kills
    a replica only while it has one far from its end)."""
    engine = DecodeEngine(tiny_llava, KVPool(256, 16, tiny_llava.kv_shape, tiny_llava.dtype))
    assert engine.most_tokens_left == 0
    for rid, max_tokens in (("short", 5), ("long", 12)):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.submit(rid, _prefilled(tiny_llava, max_tokens, 0, sampling), sampling)
    seen = []
    while engine.has_work():
        engine.step()
        seen.append(engine.most_tokens_left)
    assert seen[0] == 10 and seen[-1] == 0 and seen == sorted(seen, reverse=True)  # (12: prefill's token, one step)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_fragmented_pool_mixes_views_and_gathers(tiny_qwen, native):
    """Holes left by finished sequences force some sequences onto scattered blocks; results do not change."""
    lm = tiny_qwen
    requests = _mixed_requests(lm, 12)
    alone = {rid: list(decode(lm, pre, sp).token_ids) for rid, pre, sp in requests}
    need = sum(-(-(pre.kv.num_tokens + sp.max_tokens) // 16) for _, pre, sp in requests[:6])
    pool = KVPool(need, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool, native_attention=native)
    modes = set()
    original = engine._decode

    def spy(batch):
        modes.update(is_run(s.lease.blocks) for s in batch)
        return original(batch)

    engine._decode = spy
    assert _run(engine, requests) == alone
    assert modes == {True, False}, "the test must exercise both attention paths"
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


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_deadlines_time_out_running_and_waiting_sequences(tiny_llava):
    lm = tiny_llava
    clock = _Clock()
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    pre = _prefilled(lm, 1, 1, sampling)
    need = -(-(pre.kv.num_tokens + 40) // 16)
    pool = KVPool(need, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool, clock=clock)
    engine.submit("running", pre, sampling, deadline=5.0)
    engine.submit("waiting", pre, sampling, deadline=3.0)  # the pool fits one: this one waits for a lease
    assert engine.num_waiting == 1
    engine.step()
    clock.t = 3.0
    events = engine.step()
    assert ("waiting", None, "timeout") in [(e.request_id, e.token_id, e.finish_reason) for e in events]
    clock.t = 5.0
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("running", "timeout")]
    assert not engine.has_work()
    pool.check_no_leaks()


def test_a_failing_step_errors_its_sequences_and_frees_their_kv(tiny_llava, monkeypatch):
    lm = tiny_llava
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    engine.submit("a", _prefilled(lm, 2, 0, sampling), sampling)
    engine.step()

    def boom(*a, **k):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine, "_decode", boom)
    events = engine.step()
    assert [(e.request_id, e.token_id, e.finish_reason) for e in events] == [("a", None, "error")]
    assert isinstance(engine.last_error, RuntimeError)
    pool.check_no_leaks()


def test_engine_decodes_kv_prefilled_in_another_process(tiny_qwen, model_cache, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from common.protocol.handoff import PrefillOutput
    from common.protocol.wire import from_bytes
    from tests.unit.common.kv.kv_decode_worker import fixed_request

    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    out = tmp_path / "prefill.npz"
    worker = Path(__file__).parents[1] / "kv" / "kv_decode_worker.py"
    args = ["prefill", tiny_qwen.served_name, model_cache, str(out), sampling.model_dump_json(), "2"]
    proc = subprocess.run([sys.executable, str(worker), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    remote = from_bytes(PrefillOutput, out.read_bytes())
    local = fixed_request(tiny_qwen, 2, sampling)
    pool = KVPool(64, 16, tiny_qwen.kv_shape, tiny_qwen.dtype)
    engine = DecodeEngine(tiny_qwen, pool)
    got = _run(engine, [("remote", remote, sampling), ("local", local, sampling)])
    assert got["remote"] == got["local"] == list(decode(tiny_qwen, local, sampling).token_ids)
    pool.check_no_leaks()


def _events(engine: DecodeEngine, out: dict | None = None, once: bool = False) -> dict[str, list]:
    """``(token, finish)`` per request from the engine's steps (one step if ``once``, else until it is idle)."""
    out = {} if out is None else out
    while engine.has_work() or engine.num_waiting:
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append((ev.token_id, ev.finish_reason))
        if once:
            break
    return out


@pytest.mark.parametrize("model", ["tiny_llava", "tiny_qwen"])
def test_a_replayed_sequence_goes_on_exactly_where_the_lost_one_stopped(model, request):
    """Decode migration: each request resubmitted with the first half of its tokens (greedy, seeded, penalised,
    with and without images), batched with fresh ones, emits exactly the rest — same tokens, same finish — and every
    replayed step resamples the token the client already had."""
    lm = request.getfixturevalue(model)
    requests = _mixed_requests(lm, 12)
    alone = {rid: decode(lm, pre, sp) for rid, pre, sp in requests}
    pool = KVPool(256, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=8)
    cut = {rid: len(alone[rid].token_ids) // 2 for rid, _, _ in requests}
    got: dict[str, list] = {}
    for rid, pre, sp in requests:
        fresh = int(rid.split("-")[1]) % 3 == 0  # every third request is not a migration
        replay = [] if fresh else list(alone[rid].token_ids[: cut[rid]])
        cut[rid] = len(replay)
        engine.submit(rid, pre, sp, replay=replay)
        _events(engine, got, once=True)  # staggered: replays join a batch that is already running
    _events(engine, got)
    for rid, _, _ in requests:
        full = alone[rid]
        assert [t for t, _ in got[rid]] == list(full.token_ids[cut[rid] :]), rid
        assert got[rid][-1][1] == full.finish_reason, rid
    assert sum(cut.values()) > 20 and engine.replayed == sum(cut.values())
    assert engine.replay_mismatches == 0
    pool.check_no_leaks()


def test_replay_carries_the_stop_string_state_across_the_cut(tiny_llava):
    """A stop string that begins in the replayed tokens and ends in the first new one still stops the stream."""
    lm = tiny_llava
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    pre = _prefilled(lm, 5, 1, plain)
    ids = list(decode(lm, pre, plain).token_ids)
    stop = next(
        s
        for k in range(3, 20)
        if (s := lm.tokenizer.decode(ids[k - 1 : k + 1], skip_special_tokens=True).strip())
        and len(s) > 1
        and s not in lm.tokenizer.decode(ids[:k], skip_special_tokens=True)
    )
    sampling = plain.model_copy(update={"stop": [stop]})
    stopped = decode(lm, pre, sampling)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 24
    replay = list(stopped.token_ids[:-1])
    assert stop not in lm.tokenizer.decode(replay, skip_special_tokens=True)
    assert stop not in lm.tokenizer.decode(stopped.token_ids[-1:], skip_special_tokens=True), "it spans the cut"
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    engine.submit("s", pre, sampling, replay=replay)
    assert _events(engine) == {"s": [(stopped.token_ids[-1], "stop")]}
    pool.check_no_leaks()


def test_a_replay_as_long_as_max_tokens_is_refused(tiny_llava):
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    pool = KVPool(64, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    engine = DecodeEngine(tiny_llava, pool)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit("r", _prefilled(tiny_llava, 1, 0, sampling), sampling, replay=[1, 2, 3, 4])
    pool.check_no_leaks()


def test_a_replay_that_waits_for_its_lease_or_outlives_its_deadline(tiny_llava):
    """A replayed sequence queued behind a full pool is rebuilt when its lease comes and goes on exactly; one whose
    deadline passes while it waits times out like any other, and nothing leaks."""
    lm = tiny_llava
    clock = _Clock()
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    pre = _prefilled(lm, 3, 1, sampling)
    full = list(decode(lm, pre, sampling).token_ids)
    need = -(-(pre.kv.num_tokens + 20) // 16)
    pool = KVPool(need, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool, clock=clock)
    engine.submit("first", pre, sampling)
    engine.submit("moved", pre, sampling, replay=full[:9])
    engine.submit("late", pre, sampling, deadline=1.0, replay=full[:5])
    assert engine.num_waiting == 2
    got = _events(engine, once=True)
    clock.t = 2.0  # "late" is still waiting for a lease
    got = _events(engine, got)
    assert [t for t, _ in got["first"]] == full
    assert [t for t, _ in got["moved"]] == full[9:] and got["moved"][-1][1] == "length"
    assert got["late"] == [(None, "timeout")]
    assert engine.replayed == 9 and engine.replay_mismatches == 0
    pool.check_no_leaks()


def _land_and_start(engine: DecodeEngine, transport, rid: str, pre, sampling: SamplingParams) -> list[int] | None:
    """The decode stage's one-copy path in process: claim blocks, land the published KV in them, start."""
    blocks = engine.claim(rid, pre, sampling)
    if blocks is not None:
        opened = transport.open(transport.publish(pre, expires_at=time.time() + 60))
        transport.land(opened, Landing.of(opened.layout, engine.pool.arrays(), blocks))
        engine.start(rid, opened)
    return blocks


def test_kv_landed_in_claimed_blocks_decodes_as_submitted_kv(tiny_llava):
    """Claim (blocks allocated before the KV exists), land, start: the same tokens as :meth:`submit` with the KV in
    hand, with the landed blocks scattered among other sequences' — and nothing left in the pool after."""
    lm = tiny_llava
    requests = _mixed_requests(lm, 8)
    expected = _run(DecodeEngine(lm, KVPool(200, 16, lm.kv_shape, lm.dtype), max_batch=8), requests)
    pool = KVPool(200, 16, lm.kv_shape, lm.dtype)
    engine, transport = DecodeEngine(lm, pool, max_batch=8), make_transport("fake")
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for i, (rid, pre, sampling) in enumerate(requests):
        if i % 2:
            engine.submit(rid, pre, sampling)
        else:
            assert _land_and_start(engine, transport, rid, pre, sampling) is not None
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
    while engine.has_work():
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
    assert tokens == expected
    pool.check_no_leaks()


def test_a_claim_that_would_wait_changes_nothing_and_a_cancelled_landing_frees_its_blocks(tiny_qwen):
    lm = tiny_qwen
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    pre = _prefilled(lm, 0, 1, sampling)
    need = -(-(len(pre.prompt_token_ids) + 20) // 16)
    pool = KVPool(2 * need + 1, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=4)
    assert engine.claim("a", pre, sampling) is not None and engine.claim("b", pre, sampling) is not None
    free = pool.available_blocks
    assert engine.claim("c", pre, sampling) is None, "the pool cannot give c its blocks now"
    assert (pool.available_blocks, engine.num_landing, pool.lease("c")) == (free, 2, None)
    assert engine.reserve("d", need) is False  # a reservation queued behind a and b
    assert engine.claim("d", pre, sampling) is None, "a queued reservation is not claimed"
    assert engine.cancel("a") and engine.cancel("b")  # the decode replica's landing was cancelled (client gone)
    assert engine.num_landing == 0 and pool.granted("d"), "freed blocks went to the queued reservation"
    engine.cancel("d")
    pool.check_no_leaks()
