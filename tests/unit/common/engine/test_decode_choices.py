"""``n`` choices of one prompt: one prefill, one lease, the prompt's full blocks shared — and each choice says exactly
what the same request alone with that choice's seed says (batched beside other sequences, in every allocation)."""

from __future__ import annotations

import time

import pytest

from common.engine.decode import DecodeEngine
from common.kv.landing import Landing
from common.kv.pool import KVPool
from common.kv.transport import make_transport
from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.protocol.vector import choices_blocks
from common.reference.decode import decode_stream
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt


def _merged(lm, text: str = "What is shown here?"):
    media = process_images(lm, [synthetic_image(120, 90, seed=7)])
    content = [{"type": "image"}, {"type": "text", "text": text}]
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    return merge(lm, prompt, encode_media(lm, media))


def _alone(lm, merged, sampling: SamplingParams, block_size: int) -> list[list[tuple[int, float | None]]]:
    """Each choice run as its own request (n = 1, the choice's seed) through the reference path."""
    out = []
    for i in range(sampling.n):
        own = sampling.for_choice(i)
        steps = decode_stream(lm, prefill(lm, merged, own, block_size), own)
        out.append([(s.token_id, None if s.logprob is None else s.logprob.logprob) for s in steps])
    return out


def _collect(engine: DecodeEngine, got: dict, shared_seen: list[int]) -> None:
    for ev in engine.step():
        assert ev.token_id is not None, ev
        lp = None if ev.logprob is None else ev.logprob.logprob
        got.setdefault(ev.request_id, {}).setdefault(ev.index, []).append((ev.token_id, lp))
    shared_seen.append(sum(engine.pool.refcount(b) > 1 for b in range(engine.pool.num_blocks)))


@pytest.mark.parametrize("contiguous", [True, False], ids=["runs", "scattered"])
@pytest.mark.parametrize("aligned", [False, True], ids=["partial-last-block", "whole-blocks"])
def test_choices_equal_each_choice_alone_and_share_the_prompt(tiny_model, contiguous, aligned):
    lm = tiny_model
    block = 16
    # whole-blocks: a prompt of whole blocks (no partial last block to copy); else one that ends in a partial block
    merged = next(
        m
        for k in range(64)
        if (len((m := _merged(lm, "What is shown" + " here" * k + "?")).token_ids) % block == 0) == aligned
    )
    prompt = len(merged.token_ids)
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=41, n=4, logprobs=2, ignore_eos=True)
    expected = _alone(lm, merged, sampling, block)
    assert len({tuple(c) for c in expected}) > 1, "the seeds must make the choices differ, or nothing is tested"
    other = SamplingParams(max_tokens=9, seed=3)  # a neighbour in the batch, n = 1
    other_alone = [t for t, _ in _alone(lm, _merged(lm, "Another question."), other, block)[0]]

    pool = KVPool(400, block, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=8, prefer_contiguous=contiguous)
    engine.submit("other", prefill(lm, _merged(lm, "Another question."), other, block), other)
    engine.submit("req", prefill(lm, merged, sampling, block), sampling)
    lease = pool.lease("req")
    need = choices_blocks(block, prompt, sampling.max_tokens, 4)
    assert lease is not None and lease.reserved == need
    assert need < 4 * pool.blocks_for(prompt + sampling.max_tokens), "the prompt's full blocks are held once"
    full = prompt // block
    assert all(pool.refcount(b) == 4 for b in lease.blocks[:full]), "each choice references the shared blocks"
    got: dict = {}
    shared: list[int] = []
    _collect(engine, got, shared)
    while engine.has_work():
        _collect(engine, got, shared)
    assert [[t for t, _ in got["req"][i]] for i in range(4)] == [[t for t, _ in c] for c in expected]
    for i in range(4):  # (the batched step's floats differ from one sequence's in the last bits)
        assert [lp for _, lp in got["req"][i]] == pytest.approx([lp for _, lp in expected[i]], abs=1e-4)
    assert [t for t, _ in got["other"][0]] == other_alone
    assert shared[0] == full
    pool.check_no_leaks()


def test_choices_land_in_claimed_blocks_like_submitted_ones(tiny_llava):
    """The one-copy path (claim, land, start) forks the same way as a submit with the KV in hand."""
    lm = tiny_llava
    merged = _merged(lm)
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    pre = prefill(lm, merged, sampling, 16)
    expected = [[t for t, _ in c] for c in _alone(lm, merged, sampling, 16)]
    pool = KVPool(200, 16, lm.kv_shape, lm.dtype)
    engine, transport = DecodeEngine(lm, pool, max_batch=8), make_transport("fake")
    blocks = engine.claim("req", pre, sampling)
    assert blocks is not None
    opened = transport.open(transport.publish(pre, expires_at=time.time() + 60))
    transport.land(opened, Landing.of(opened.layout, pool.arrays(), blocks))
    engine.start("req", opened)
    got: dict = {}
    while engine.has_work():
        _collect(engine, got, [])
    assert [[t for t, _ in got["req"][i]] for i in range(3)] == expected
    pool.check_no_leaks()


def test_choices_finish_on_their_own_and_end_together_on_a_deadline(tiny_qwen):
    lm = tiny_qwen
    merged = _merged(lm)
    now = [0.0]
    pool = KVPool(200, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=8, clock=lambda: now[0])
    sampling = SamplingParams(max_tokens=30, temperature=1.0, seed=9, n=3, ignore_eos=True)
    engine.submit("late", prefill(lm, merged, sampling, 16), sampling, deadline=5.0)
    events = engine.step()
    assert sorted({e.index for e in events}) == [0, 1, 2]
    now[0] = 6.0
    events = engine.step()
    assert [(e.request_id, e.token_id, e.finish_reason) for e in events] == [("late", None, "timeout")]
    assert not engine.has_work()
    pool.check_no_leaks()
    # cancelled mid-way: every choice goes, the lease with them
    engine.submit("gone", prefill(lm, merged, sampling, 16), sampling)
    engine.step()
    assert engine.num_running == 3
    assert engine.cancel("gone")
    assert engine.num_running == 0 and not engine.has_work()
    pool.check_no_leaks()


def test_a_prefill_without_the_choices_first_tokens_or_a_replay_of_choices_is_refused(tiny_llava):
    lm = tiny_llava
    merged = _merged(lm)
    one = SamplingParams(max_tokens=4, seed=1)
    engine = DecodeEngine(lm, KVPool(100, 16, lm.kv_shape, lm.dtype))
    with pytest.raises(Exception, match="first tokens for n=3"):
        engine.submit("a", prefill(lm, merged, one, 16), one.model_copy(update={"n": 3}))
    three = one.model_copy(update={"n": 3})
    with pytest.raises(ValueError, match="not replayed"):
        engine.submit("b", prefill(lm, merged, three, 16), three, replay=(1,))
    engine.pool.check_no_leaks()


def test_a_failed_grammar_in_one_choice_ends_its_request_alone_in_the_step(tiny_llava):
    """One choice's grammar failing at the step where its sibling finishes ends that request — one error event, its
    lease back — and the step goes on for every other sequence in the batch."""
    from common.grammar.formats import guide_from_request

    lm = tiny_llava
    merged = _merged(lm)
    guide = guide_from_request({"guided_regex": "[a-z]{30,40}"}, 1 << 16)
    two = SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=2, guide=guide)
    other = SamplingParams(max_tokens=6, seed=4, ignore_eos=True)
    pool = KVPool(100, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    engine.submit("other", prefill(lm, _merged(lm, "Another question."), other, 16), other)
    engine.submit("two", prefill(lm, merged, two, 16), two)
    engine.take_events()

    advance = engine._advance

    def fails_for_choice_0(seq, token):  # (what a matcher that met a parser limit does: abort, False)
        if seq.key == ("two", 0):
            engine._abort("two", "error")
            return False
        return advance(seq, token)

    engine._advance = fails_for_choice_0
    events = engine.step()  # (choice 1 reaches max_tokens in this very step)
    assert [(e.token_id, e.finish_reason) for e in events if e.request_id == "two"] == [(None, "error")]
    assert [e.finish_reason for e in events if e.request_id == "other"] == [None], "the neighbour goes on"
    assert engine.failed_steps == 0 and pool.lease("two") is None
    while engine.has_work():
        engine.step()
    pool.check_no_leaks()
