"""Chunked prefill equals unchunked (spans kept whole where a family asks for it); the prefix cache hits only on
identical media, and may end inside an image for the families whose LM is causal over it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.engine.chunking import plan_chunks, usable_prefix_blocks
from common.engine.prefill import PrefillEngine
from common.kv.prefix_hash import block_hashes
from common.media.synthetic import synthetic_image
from common.protocol.handoff import PlaceholderSpan
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt

SAMPLING = SamplingParams(max_tokens=12)


def _merged(lm, images, text="and compare them"):
    content = [{"type": "text", "text": "Look at this picture please"}]
    for _ in images:
        content += [{"type": "image"}, {"type": "text", "text": "then"}]
    content.append({"type": "text", "text": text})
    media = process_images(lm, images)
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    return merge(lm, prompt, encode_media(lm, media))


def _image_then(lm, image, question):
    """The image first, the question right after it: a new question differs from the first token after the image."""
    media = process_images(lm, [image])
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return merge(lm, build_prompt(lm, [{"role": "user", "content": content}], media, 4096), encode_media(lm, media))


def _tokens(lm, pre):
    return decode(lm, pre, SAMPLING).token_ids


def _span(start, length):
    return PlaceholderSpan(0, "image", start, length, (length, 8), "d", (1, 2, 2))


def test_chunk_plan_never_cuts_a_span():
    spans = [_span(10, 144), _span(158, 30)]
    chunks = plan_chunks(200, spans, 40)
    assert chunks[0] == (0, 10) and (10, 154) in chunks
    assert chunks[0][0] == 0 and chunks[-1][1] == 200
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    for s, e in chunks:
        for span in spans:
            assert not span.prompt_token_start < s < span.end and not span.prompt_token_start < e < span.end
    assert plan_chunks(200, spans, 40, allow_split=True)[1] == (40, 80)
    assert usable_prefix_blocks(2, 16, spans, allow_split=False) == 0  # 32 is inside the first span
    assert usable_prefix_blocks(12, 16, spans, allow_split=False) == 12  # 192 is after both


@pytest.mark.parametrize("chunk", [7, 40, 100])
def test_chunked_prefill_equals_unchunked(tiny_model, chunk):
    lm = tiny_model
    merged = _merged(lm, [synthetic_image(200, 150, seed=1), synthetic_image(120, 300, seed=2)])
    whole = prefill(lm, merged, SAMPLING, 16)
    result = PrefillEngine(lm, 16, chunk_tokens=chunk).run("r", merged, SAMPLING)
    assert len(result.stats.chunks) >= 2
    assert result.output.first_token_id == whole.first_token_id
    assert result.output.rope_delta == whole.rope_delta
    np.testing.assert_allclose(result.output.kv.keys, whole.kv.keys, atol=1e-4)
    np.testing.assert_allclose(result.output.kv.values, whole.kv.values, atol=1e-4)
    assert _tokens(lm, result.output) == _tokens(lm, whole)


def test_prefix_hit_equals_recompute_and_skips_compute(tiny_model):
    lm = tiny_model
    merged = _merged(lm, [synthetic_image(200, 150, seed=1)])
    engine = PrefillEngine(lm, 16, chunk_tokens=64, prefix_cache_blocks=128)
    cold = engine.run("a", merged, SAMPLING)
    hot = engine.run("b", merged, SAMPLING)
    n = len(merged.token_ids)
    assert cold.stats.cached_tokens == 0 and cold.stats.computed_tokens == n
    assert hot.stats.cached_tokens >= n - 16 and hot.stats.computed_tokens == n - hot.stats.cached_tokens
    np.testing.assert_allclose(hot.output.kv.keys, cold.output.kv.keys, atol=1e-5)
    assert hot.output.first_token_id == cold.output.first_token_id
    assert _tokens(lm, hot.output) == _tokens(lm, cold.output)
    assert engine.prefix.stats.hit_blocks == hot.stats.cached_tokens // 16
    assert cold.stats.started_at is not None and hot.stats.started_at >= cold.stats.started_at


def test_same_image_new_question_reuses_the_image_and_equals_recompute(tiny_model):
    """The multi-question pattern: the image (≥ 8 blocks of visual tokens) before the question, a new question → the
    hit ends inside the image span, at its last full block, and the answer is the uncached engine's."""
    lm = tiny_model
    assert lm.adapter.allows_span_split
    image = synthetic_image(336, 336, seed=5)
    first = _image_then(lm, image, "what colour is the sky in it")
    second = _image_then(lm, image, "how many people are standing there")
    span = second.spans[0]
    # (the tiny Qwen2-VL caps an image at 64 visual tokens; 7 keeps its last full block inside the image, since its
    # question starts two tokens after the span, behind <|vision_end|>)
    bs = 16 if span.prompt_token_length >= 8 * 16 else 7
    assert span.prompt_token_length >= 8 * bs
    engine = PrefillEngine(lm, bs, chunk_tokens=64, prefix_cache_blocks=256)
    engine.run("a", first, SAMPLING)
    hot = engine.run("b", second, SAMPLING)
    differ = int(np.argmax(first.token_ids[: len(second.token_ids)] != second.token_ids[: len(first.token_ids)]))
    assert differ >= span.end, "the prompts share the whole image"
    assert hot.stats.cached_tokens == differ // bs * bs, "the hit reaches the last full block before the question"
    cached_visual = min(hot.stats.cached_tokens, span.end) - span.prompt_token_start
    assert hot.stats.cached_visual_tokens == cached_visual
    assert hot.stats.cached_tokens < span.end, "the hit ends inside the image"
    trimmed = usable_prefix_blocks(hot.stats.cached_tokens // bs, bs, second.spans, allow_split=False)
    assert trimmed * bs <= span.prompt_token_start, "what a family that keeps spans whole would have reused"
    assert cached_visual >= 0.8 * span.prompt_token_length
    assert hot.stats.computed_tokens == len(second.token_ids) - hot.stats.cached_tokens
    cold = PrefillEngine(lm, bs, chunk_tokens=64).run("c", second, SAMPLING)
    np.testing.assert_allclose(hot.output.kv.keys, cold.output.kv.keys, atol=1e-5)
    np.testing.assert_allclose(hot.output.kv.values, cold.output.kv.values, atol=1e-5)
    assert hot.output.first_token_id == cold.output.first_token_id
    assert _tokens(lm, hot.output) == _tokens(lm, cold.output)


def test_a_family_that_keeps_spans_whole_still_trims_the_hit(tiny_llava, monkeypatch):
    """The adapter decides: without ``allows_span_split`` the hit ends at the image's start, as before."""
    lm = tiny_llava
    monkeypatch.setattr(type(lm.adapter), "allows_span_split", False)
    image = synthetic_image(336, 336, seed=5)
    first = _image_then(lm, image, "what colour is the sky in it")
    second = _image_then(lm, image, "how many people are standing there")
    engine = PrefillEngine(lm, 16, chunk_tokens=64, prefix_cache_blocks=128)
    engine.run("a", first, SAMPLING)
    hot = engine.run("b", second, SAMPLING)
    assert hot.stats.cached_tokens <= second.spans[0].prompt_token_start
    assert _tokens(lm, hot.output) == _tokens(lm, PrefillEngine(lm, 16).run("c", second, SAMPLING).output)


def test_different_image_at_same_position_does_not_hit(tiny_model):
    """Same text, same image size and position, different pixels: only blocks before the image may hit."""
    lm = tiny_model
    first = _merged(lm, [synthetic_image(200, 150, seed=1)])
    other = _merged(lm, [synthetic_image(200, 150, seed=2)])
    assert np.array_equal(first.token_ids, other.token_ids), "the token ids alone cannot tell these apart"
    engine = PrefillEngine(lm, 16, chunk_tokens=64, prefix_cache_blocks=128)
    engine.run("a", first, SAMPLING)
    hit = engine.run("b", other, SAMPLING)
    assert hit.stats.cached_tokens <= other.spans[0].prompt_token_start
    alone = PrefillEngine(lm, 16, chunk_tokens=64).run("c", other, SAMPLING)
    assert _tokens(lm, hit.output) == _tokens(lm, alone.output)
    assert _tokens(lm, hit.output) != _tokens(lm, engine.run("d", first, SAMPLING).output)


def test_prefix_hash_binds_tenant_model_and_media():
    ids = np.arange(64)
    span = [PlaceholderSpan(0, "image", 16, 16, (16, 8), "digest-a", (1, 4, 4))]
    base = block_hashes(ids, span, 16, "rev1", "tenant-a")
    assert len(base) == 4
    assert block_hashes(ids, span, 16, "rev1", "tenant-b")[0] != base[0]
    assert block_hashes(ids, span, 16, "rev2", "tenant-a")[0] != base[0]
    other_media = [PlaceholderSpan(0, "image", 16, 16, (16, 8), "digest-b", (1, 4, 4))]
    changed = block_hashes(ids, other_media, 16, "rev1", "tenant-a")
    assert changed[0] == base[0] and changed[1] != base[1] and changed[3] != base[3]  # chained: all later differ


def test_other_tenant_misses_unless_shared(tiny_llava):
    merged = _merged(tiny_llava, [synthetic_image(100, 100, seed=3)])
    engine = PrefillEngine(tiny_llava, 16, prefix_cache_blocks=128)
    engine.run("a", merged, SAMPLING, tenant="acme")
    assert engine.run("b", merged, SAMPLING, tenant="globex").stats.cached_tokens == 0
    assert engine.run("c", merged, SAMPLING, tenant="acme").stats.cached_tokens > 0
    shared = PrefillEngine(tiny_llava, 16, prefix_cache_blocks=128, shared_prefix_scope=True)
    shared.run("a", merged, SAMPLING, tenant="acme")
    assert shared.run("b", merged, SAMPLING, tenant="globex").stats.cached_tokens > 0


def test_token_budget_spreads_across_requests_and_cache_stays_bounded(tiny_llava):
    lm = tiny_llava
    engine = PrefillEngine(lm, 16, chunk_tokens=64, prefix_cache_blocks=24)
    merged = [_merged(lm, [synthetic_image(90, 90, seed=i)], text=f"number {i}") for i in range(4)]
    for i, m in enumerate(merged):
        engine.submit(f"r{i}", m, SAMPLING)
    assert engine.queued_tokens == sum(len(m.token_ids) for m in merged)
    done = {}
    steps = 0
    while engine.has_work():
        for r in engine.step(token_budget=200):
            done[r.request_id] = r
        steps += 1
    assert steps >= sum(len(m.token_ids) for m in merged) // 200 and len(done) == 4
    for i, m in enumerate(merged):
        assert done[f"r{i}"].output.first_token_id == prefill(lm, m, SAMPLING, 16).first_token_id
    assert len(engine.prefix) <= 24 and engine.pool.used_blocks == len(engine.prefix)
    engine.prefix.clear()
    engine.pool.check_no_leaks()
    engine.submit("gone", merged[0], SAMPLING)
    assert engine.cancel("gone") and not engine.has_work()


def _text(lm, words: str):
    prompt = build_prompt(lm, [{"role": "user", "content": words}], [], 4096)
    return merge(lm, prompt, [])


def test_short_prompt_overtakes_a_large_one_queued_before_it_and_results_are_unchanged(tiny_llava):
    """The low-latency lane: a text prompt submitted after a large image prompt finishes first (it is not held
    behind the image's chunks), a large prompt that has waited long enough is not overtaken, and the order changes
    no token."""
    lm = tiny_llava
    big = _merged(lm, [synthetic_image(200, 150, seed=1), synthetic_image(120, 300, seed=2)])
    small = _text(lm, "hi there")
    engine = PrefillEngine(lm, 16, chunk_tokens=32, aging_tokens_per_s=100.0)
    engine.submit("big", big, SAMPLING, arrival=10.0)
    engine.submit("small", small, SAMPLING, arrival=10.1)
    first = engine.step(32)
    assert [r.request_id for r in first] == ["small"]  # done in the first step, though it came second
    order = list(first)
    while engine.has_work():
        order += engine.step(32)
    assert [r.request_id for r in order] == ["small", "big"]
    alone = {rid: PrefillEngine(lm, 16, chunk_tokens=32).run(rid, m, SAMPLING) for rid, m in (("b", big), ("s", small))}
    assert _tokens(lm, order[1].output) == _tokens(lm, alone["b"].output)
    assert _tokens(lm, order[0].output) == _tokens(lm, alone["s"].output)
    # Aging: the big prompt ranks arrival + tokens / 100; a text prompt arriving later than that goes after it.
    engine = PrefillEngine(lm, 16, chunk_tokens=32, aging_tokens_per_s=100.0)
    engine.submit("big", big, SAMPLING, arrival=10.0)
    engine.submit("late", small, SAMPLING, arrival=10.0 + len(big.token_ids) / 100.0 + 1.0)
    assert engine.step(10_000)[0].request_id == "big"
    # Batch class: ranked batch_delay_s later than interactive work of the same size.
    engine = PrefillEngine(lm, 16, chunk_tokens=32, aging_tokens_per_s=100.0, batch_delay_s=5.0)
    engine.submit("batch", small, SAMPLING, arrival=10.0, batch=True)
    engine.submit("interactive", small, SAMPLING, arrival=12.0)
    assert engine.step(10_000)[0].request_id == "interactive"


def test_expired_prompts_are_dropped_before_any_compute(tiny_llava):
    now = [0.0]
    engine = PrefillEngine(tiny_llava, 16, chunk_tokens=32, clock=lambda: now[0])
    engine.submit("late", _text(tiny_llava, "hello"), SAMPLING, deadline=5.0)
    engine.submit("fine", _text(tiny_llava, "hello again"), SAMPLING, deadline=50.0)
    now[0] = 6.0
    assert engine.expire() == ["late"]
    assert engine.computed_tokens == 0
    done = engine.step(10_000)
    assert [r.request_id for r in done] == ["fine"] and engine.computed_tokens == len(done[0].output.prompt_token_ids)
