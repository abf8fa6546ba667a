"""The cache-reach figures' arithmetic (loadtest.bench_cache), from traces shaped like Prism's."""

from __future__ import annotations

import pytest

from loadtest import bench_cache
from loadtest.stats import RequestRecord


def _rec(hits: int, misses: int, cached: int, visual: int, encode: str = "e1", prefill: str = "p1", status=200):
    trace = {
        "visual_tokens": visual,
        "cache": {
            "encoder": {"hits": hits, "misses": misses},
            "prefix": {"cached_tokens": cached + 4, "cached_visual_tokens": cached},
            "routing": {"encode": {"outcome": "owner", "replica": encode}, "prefill": {"replica": prefill}},
        },
    }
    return RequestRecord(kind="image", sent_at=0.0, status=status, ttft_s=0.1, trace=trace)


def test_hit_rate_prefix_reuse_and_replicas():
    records = [
        _rec(1, 0, 300, 320),
        _rec(1, 0, 320, 320, encode="e2"),
        _rec(0, 1, 0, 320),
        _rec(1, 0, 9, 9, status=500),
    ]
    assert bench_cache.hit_rate(records) == pytest.approx(2 / 3)  # the failed request is not counted
    assert bench_cache.prefix_reuse(records) == pytest.approx((300 + 320) / 960)
    assert bench_cache.replicas_used(records, "encode") == {"e1": 3, "e2": 1}
    assert bench_cache.hit_rate([]) is None and bench_cache.prefix_reuse([_rec(0, 0, 0, 0)]) is None


def test_the_figures_come_from_the_hot_runs_and_the_app_has_two_replicas_where_it_matters():
    cold = [[_rec(0, 1, 0, 320)] * 3 for _ in range(3)]
    hot = [[_rec(1, 0, 300, 320)] * 3 for _ in range(3)]
    for r in (x for run in cold for x in run):
        object.__setattr__(r, "ttft_s", 0.4)
    out = bench_cache.figures("m", cold, hot)
    assert out["encoder_cache_hot_cold_ttft_ratio"]["value"] == pytest.approx(0.25)
    assert out["encoder_hit_rate_2_replicas"]["value"] == 1.0 and out["encoder_hit_rate_2_replicas"]["met"]
    assert out["prefix_reuse_fraction"]["value"] == pytest.approx(300 / 320)
    cfg = bench_cache.app_config({"model": {"model": "x", "torch_threads": 1}, "deployments": {"media": {}}})
    assert cfg["model"] == {"model": bench_cache.MODEL, "torch_threads": 1}
    assert cfg["deployments"]["encode"]["min_replicas"] == cfg["deployments"]["prefill"]["max_replicas"] == 2
    shares = sum(d.get("num_cpus", 0.25) * d.get("min_replicas", 1) for d in cfg["deployments"].values())
    assert shares < 2
