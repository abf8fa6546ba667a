"""Traces, the request summary, keyed media hashes, the metric catalogue and per-request cache tallies."""

from __future__ import annotations

import json
import re

from common.cache.processor_cache import ProcessorCache
from common.cache.tally import TalliedCache
from common.obs.catalogue import METRICS
from common.obs.keyed_hash import keyed_hash
from common.obs.request_trace import RequestTrace
from common.obs.trace import Span, Timeline, Traced, durations, unwrap


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def test_timeline_spans_are_contiguous_and_continue_across_stages():
    clock = Clock()
    media = Timeline(clock(), clock=clock)
    clock.advance(0.010)
    media.mark("media.queue")
    media.span("media.fetch", 0.004, bytes=10)
    clock.advance(0.020)
    media.mark("media.process", visual_tokens=144)
    handed = media.wrap(["pixels"])
    assert handed.end == clock() and unwrap(handed) == ["pixels"] and unwrap(["x"]) == ["x"]
    clock.advance(0.005)
    encode = Timeline.after(handed, sent_at=0.0, clock=clock)  # continues from where media ended
    encode.mark("encode.transfer")
    names = [s.name for s in encode.spans]
    assert names == ["media.queue", "media.fetch", "media.process", "encode.transfer"]
    for a, b in zip(encode.spans, encode.spans[1:], strict=False):
        assert abs(a.end - b.start) < 1e-9
    assert abs(sum(s.duration_s for s in encode.spans) - 0.035) < 1e-9
    assert abs(durations(encode.spans, "media") - 0.030) < 1e-9
    first = Timeline.after(["not traced"], sent_at=clock() - 1, clock=clock)
    assert first.last == clock() - 1 and not first.spans


def test_negative_durations_are_clamped():
    timeline = Timeline(10.0, clock=lambda: 9.0)  # a clock skewed behind the upstream's end
    assert timeline.mark("x").duration_s == 0.0 and timeline.span("y", -1).duration_s == 0.0


def test_request_trace_summary_decomposes_ttft_and_times_tokens():
    clock = Clock()
    trace = RequestTrace("chatcmpl-1", "http", clock=clock)
    trace.tenant = "tenant-a"
    clock.advance(0.002)
    trace.sent(media_items=1)
    upstream = Timeline(trace.timeline.last, clock=clock)
    upstream.span("media.process", 0.030, visual_tokens=144, processor_cache_hits=1, media=["abcd"])
    upstream.span("encode", 0.010, encoder_cache_misses=1, visual_tokens=144)
    upstream.span("prefill", 0.020, prompt_tokens=170, prefix_cached_tokens=32, prefix_cached_visual_tokens=16)
    trace.absorb(upstream.spans)
    trace.route("prefill", "owner", "r1")
    trace.prompt_tokens = 170
    clock.advance(0.070)
    assert trace.token() is None
    for gap in (0.004, 0.006):
        clock.advance(gap)
        assert abs(trace.token() - gap) < 1e-9
    trace.finish(200, "ok", kv_blocks=11)
    trace.finish(500, "late")  # finishing twice keeps the first outcome
    s = trace.summary()
    assert (s["status"], s["code"], s["tenant"]) == (200, "ok", "tenant-a")
    assert s["ttft_ms"] == 72.0 and s["e2e_ms"] == 82.0 and s["output_tokens"] == 3
    assert s["visual_tokens"] == 144  # counted once, from media.process
    assert s["cache"] == {
        "processor": {"hits": 1, "misses": 0},
        "encoder": {"hits": 0, "misses": 1},
        "prefix": {"cached_tokens": 32, "cached_visual_tokens": 16},
        "routing": {"prefill": {"outcome": "owner", "replica": "r1"}},
    }
    names = [sp["name"] for sp in s["spans"]]
    assert names == ["ingress", "media.process", "encode", "prefill", "first_token", "decode"]
    before_decode = sum(sp["duration_ms"] for sp in s["spans"][:-1])
    assert abs(before_decode - s["ttft_ms"]) < 1e-6
    assert s["spans"][-1]["attrs"] == {"kv_blocks": 11, "output_tokens": 3, "itl_mean_ms": 5.0, "itl_max_ms": 6.0}
    assert s["itl_ms"] == {"mean": 5.0, "p50": 6.0, "p95": 6.0, "max": 6.0}
    line = json.loads(trace.log_line())
    assert line["event"] == "prism.request" and line["request_id"] == "chatcmpl-1"
    assert line["cache"] == s["cache"]  # the operator's log keeps cache outcomes whatever clients are shown
    # what a client sees without observability.trace_cache_hits: the same timings, no trace of a hit or a miss
    blind = trace.summary(cache_outcomes=False)
    assert "cache" not in blind and blind["ttft_ms"] == s["ttft_ms"]
    assert [sp["name"] for sp in blind["spans"]] == names
    text = json.dumps(blind)
    assert "cache" not in text and "media.process" in text and '"visual_tokens": 144' in text
    assert "routing" not in text and "owner" not in text  # where a call went tells where a cache holds it


def test_a_request_that_failed_early_has_no_token_figures():
    trace = RequestTrace("r", "grpc", clock=Clock())
    trace.finish(400, "invalid_request")
    s = trace.summary()
    assert s["ttft_ms"] is None and s["itl_ms"] is None and s["output_tokens"] == 0 and s["spans"] == []


def test_keyed_hash_depends_on_the_key_and_hides_the_digest():
    digest = "ab" * 32
    a, b = keyed_hash("k1", digest), keyed_hash("k2", digest)
    assert a != b and len(a) == 16 and a not in digest and keyed_hash("k1", digest) == a


def test_catalogue_names_are_prefixed_unique_and_ray_safe():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert re.fullmatch(r"prism_[a-z0-9_]+", m.name), m.name
        assert m.description.isascii(), m.name  # Ray refuses non-ASCII metric descriptions
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert (m.kind == "histogram") == bool(m.buckets), m.name
        assert list(m.buckets) == sorted(m.buckets)
        if m.in_replica:  # Serve adds these itself and refuses them as user tags inside a replica
            assert not set(m.tags) & {"application", "deployment", "replica"}, m.name
    required = {"prism_kv_blocks_used", "prism_kv_blocks_free", "prism_ttft_seconds", "prism_itl_seconds"}
    assert required <= set(names)


def test_tallied_cache_counts_one_requests_own_outcomes():
    import numpy as np

    from common.model.families.base import ProcessedPixels

    shared = ProcessorCache(1 << 20)
    key = shared.key("t", "digest", "Proc", "rev", {}, "float32")
    other = TalliedCache(shared)
    assert other.get(key) is None
    other.put(key, ProcessedPixels(np.zeros(4, np.float32), (1, 1, 1), 1))
    mine = TalliedCache(shared)
    assert mine.get(key) is not None and mine.key("t", "digest", "Proc", "rev", {}, "float32") == key
    assert (mine.hits, mine.misses, other.hits, other.misses) == (1, 0, 0, 1)
    assert shared.stats().hits == 1 and shared.stats().misses == 1


def test_span_is_plain_data():
    span = Span("x", 1.0, 0.5, {"a": 1})
    assert span.end == 1.5 and Traced(1, (span,), 1.5).spans[0] is span
