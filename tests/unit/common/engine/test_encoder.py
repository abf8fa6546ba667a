"""Encoder cache (hit == recompute, tenant-scoped, cost-per-byte eviction) and batching (small overtakes large,
large never starves)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.cache.encoder_cache import EncoderCache
from common.engine.encode import EncodeEngine
from common.media.synthetic import synthetic_image
from common.protocol.handoff import ProcessedMedia
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.sched.encoder_batcher import EncodeItem, EncoderBatcher
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _media(patches: int, idx: int = 0, digest: str = "d") -> ProcessedMedia:
    return ProcessedMedia(idx, "image", digest, np.zeros((1,), np.float32), (1, 1, patches), patches // 4, (1, 1))


def _run(engine: EncodeEngine, rid: str, items, tenant="default"):
    out = engine.submit(rid, items, tenant=tenant)
    while out is None:
        out = engine.step().get(rid)
    return out


def test_encoder_cache_hit_equals_recompute(tiny_model):
    lm = tiny_model
    images = [synthetic_image(160, 120, seed=1), synthetic_image(90, 200, seed=2)]
    media = process_images(lm, images)
    cache = EncoderCache(max_bytes=64 << 20)
    engine = EncodeEngine(lm, EncoderBatcher(), cache)
    cold = _run(engine, "a", media)
    assert cache.stats().misses == 2 and cache.stats().entries == 2
    hot = engine.submit("b", media)  # all hits: answered without a step
    assert hot is not None and cache.stats().hits == 2
    # each request's own outcome, for its trace; forgotten once collected
    cold_stats, hot_stats = engine.pop_stats("a"), engine.pop_stats("b")
    assert (cold_stats.cache_hits, cold_stats.cache_misses) == (0, 2) and cold_stats.started_at is not None
    assert (hot_stats.cache_hits, hot_stats.cache_misses) == (0 + 2, 0) and hot_stats.started_at is None
    assert engine.pop_stats("a") is None
    fresh = encode_media(lm, media)
    for c, h, f in zip(cold, hot, fresh, strict=True):
        np.testing.assert_array_equal(h.embeddings, c.embeddings)
        np.testing.assert_allclose(h.embeddings, f.embeddings, atol=1e-5)
        assert (h.media_index, h.media_digest, h.encoder_revision) == (
            f.media_index,
            f.media_digest,
            f.encoder_revision,
        )

    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "compare"}]
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    sampling = SamplingParams(max_tokens=10)

    def tokens(embs):
        return decode(lm, prefill(lm, merge(lm, prompt, embs), sampling, 16), sampling).token_ids

    assert tokens(hot) == tokens(fresh)


def test_encoder_cache_is_tenant_scoped(tiny_llava):
    media = process_images(tiny_llava, [synthetic_image(64, 64, seed=5)])
    cache = EncoderCache(max_bytes=64 << 20)
    engine = EncodeEngine(tiny_llava, EncoderBatcher(), cache)
    _run(engine, "a", media, tenant="acme")
    assert engine.submit("b", media, tenant="globex") is None  # miss: queued for encoding
    assert _run(engine, "c", media, tenant="acme") is not None and cache.stats().hits == 1


def test_eviction_prefers_cheap_per_byte_entries():
    cache = EncoderCache(max_bytes=3000)
    emb = np.zeros((250,), np.float32)  # 1000 bytes each
    cache.put(cache.key("t", "expensive", "p", "e"), emb.copy(), recompute_cost=0.300)
    cache.put(cache.key("t", "cheap-old", "p", "e"), emb.copy(), recompute_cost=0.002)
    cache.put(cache.key("t", "cheap-new", "p", "e"), emb.copy(), recompute_cost=0.002)
    assert cache.get(cache.key("t", "expensive", "p", "e")) is not None  # oldest use now: LRU would evict another
    cache.put(cache.key("t", "incoming", "p", "e"), emb.copy(), recompute_cost=0.010)
    assert cache.key("t", "expensive", "p", "e") in cache, "expensive-per-byte entry survives"
    assert cache.key("t", "cheap-old", "p", "e") not in cache, "cheapest per byte, least recently used goes"
    assert cache.key("t", "cheap-new", "p", "e") in cache
    assert cache.stats().bytes <= 3000 and cache.stats().evictions == 1


def test_small_images_overtake_a_queue_of_large_ones():
    clock = FakeClock()
    batcher = EncoderBatcher(patch_budget=4096, aging_patches_per_s=100.0)
    for i in range(4):
        batcher.add(EncodeItem(f"large{i}", _media(4096), clock()))
    clock.t = 1.0
    for i in range(3):
        batcher.add(EncodeItem(f"small{i}", _media(64), clock()))
    first = batcher.next_batch(clock())
    assert sorted(i.request_id for i in first) == ["small0", "small1", "small2"], "one batch, one bucket"
    assert [i.request_id for i in batcher.next_batch(clock())] == ["large0"]  # then large ones, within budget


def test_large_images_are_not_starved_by_a_stream_of_small_ones():
    clock = FakeClock()
    batcher = EncoderBatcher(patch_budget=4096, aging_patches_per_s=1000.0)
    batcher.add(EncodeItem("large", _media(4096), clock()))
    served_at = None
    for step in range(100):
        clock.t = step * 0.5
        batcher.add(EncodeItem(f"small{step}", _media(64), clock()))
        if any(i.request_id == "large" for i in batcher.next_batch(clock())):
            served_at = clock.t
            break
    assert served_at is not None and served_at <= 4096 / 1000.0 + 0.5


def test_batch_class_items_go_behind_interactive_ones_and_are_not_starved():
    clock = FakeClock()
    batcher = EncoderBatcher(patch_budget=64, aging_patches_per_s=1000.0, batch_delay_s=2.0)
    batcher.add(EncodeItem("offline", _media(64), clock(), batch=True))  # small and first, but batch class
    clock.t = 0.5
    batcher.add(EncodeItem("chat", _media(512), clock()))  # larger, later, interactive
    assert [i.request_id for i in batcher.next_batch(clock())] == ["chat"]
    # a stream of interactive items goes first only while they arrive within batch_delay_s of the batch item
    served_at = None
    for step in range(1, 40):
        clock.t = 0.5 + step * 0.25
        batcher.add(EncodeItem(f"chat{step}", _media(64), clock()))
        if any(i.request_id == "offline" for i in batcher.next_batch(clock())):
            served_at = clock.t
            break
    assert served_at is not None and 2.0 <= served_at <= 2.0 + 0.25 + 64 / 1000.0
    # without a delay the class changes nothing: the same rank as before (fewest patches first)
    plain = EncoderBatcher(patch_budget=64, aging_patches_per_s=1000.0)
    plain.add(EncodeItem("offline", _media(64), 0.0, batch=True))
    plain.add(EncodeItem("chat", _media(512), 0.5))
    assert [i.request_id for i in plain.next_batch(0.5)] == ["offline"]
    with pytest.raises(ValueError, match="aging"):
        EncoderBatcher(aging_patches_per_s=0)


def test_encode_engine_batches_across_requests_and_cancels(tiny_qwen):
    lm = tiny_qwen
    clock = FakeClock()
    engine = EncodeEngine(lm, EncoderBatcher(patch_budget=100_000), EncoderCache(64 << 20), clock=clock)
    big = process_images(lm, [synthetic_image(224, 224, seed=1)])
    small = [replace(m, media_index=0) for m in process_images(lm, [synthetic_image(56, 56, seed=2)])]
    assert engine.submit("big", big) is None
    assert engine.submit("small", small) is None
    assert engine.submit("gone", process_images(lm, [synthetic_image(60, 60, seed=3)])) is None
    assert engine.cancel("gone")
    done = engine.step()
    assert list(done) == ["small"], "the small image is encoded first"
    assert list(engine.step()) == ["big"] and not engine.has_work()


def test_encode_engine_ranks_a_batch_class_request_behind_interactive_ones(tiny_qwen):
    lm = tiny_qwen
    engine = EncodeEngine(lm, EncoderBatcher(patch_budget=100_000, batch_delay_s=100.0), None, clock=FakeClock())
    small = process_images(lm, [synthetic_image(56, 56, seed=2)])
    assert engine.submit("offline", small, batch=True) is None  # smaller and first, but batch class
    assert engine.submit("chat", process_images(lm, [synthetic_image(224, 224, seed=1)])) is None
    assert list(engine.step()) == ["chat"]
    assert list(engine.step()) == ["offline"] and not engine.has_work()


def test_expired_requests_leave_the_encoder_queue_before_a_batch(tiny_llava):
    clock = FakeClock()
    engine = EncodeEngine(tiny_llava, EncoderBatcher(patch_budget=10_000), None, clock)
    media = process_images(tiny_llava, [synthetic_image(64, 64, seed=1)])
    assert engine.submit("late", media, deadline=5.0) is None
    assert engine.submit("fine", media, deadline=50.0) is None
    assert engine.uncached_patches(media) == sum(m.grid_thw[0] * m.grid_thw[1] * m.grid_thw[2] for m in media)
    clock.t = 6.0
    assert engine.expire() == ["late"]
    assert engine.batches == 0 and engine.batcher.pending_items == 1
    assert set(engine.step()) == {"fine"} and engine.batches == 1 and engine.items_encoded == 1
