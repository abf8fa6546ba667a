"""``make bench``'s cache-reach figures: repeated images asked new questions, across two replicas per stage.

They run on the model whose vision tower matters (``prism-small-qwen2vl``: its encoder is a large part of a cold
request's TTFT, where ``prism-small-llava``'s is not), in a Prism application of its own with **2 encode and 2 prefill
replicas**, so the affinity routers (:mod:`services.routers.affinity`) decide whether a repeat finds its cache. Run
``i``:

1. a **cold** load — unique medium images, light open-loop load (every cache misses);
2. the hot set **primed** — each of :data:`HOT_IMAGES` medium images asked once, untimed;
3. a **hot** load — the same load, each request one of the hot images at random with a question never asked before
   (``Workload.fresh_questions``): the encoder cache should hit, and the prefix cache reuse the image's KV up to its
   last full block; only the question and what follows are computed.

Figures, from the hot loads' traces (``observability.trace_cache_hits``):

* ``encoder_cache_hot_cold_ttft_ratio`` — p50 TTFT hot / cold;
* ``encoder_hit_rate_2_replicas`` — encoder-cache hits / media items;
* ``prefix_reuse_fraction`` — visual tokens the prefix cache held / visual tokens (the prefill span's
  ``prefix_cached_visual_tokens``): the image's last partial block is recomputed, so 1 is out of reach by design. A
  hit trimmed to the image's start — what every family did before span splits — reads 0.
"""

from __future__ import annotations

from typing import Any

import httpx

from loadtest import bench_loads as loads
from loadtest.bench_servers import KEY
from loadtest.figures import record
from loadtest.stats import RequestRecord
from loadtest.workload import OutputLengths, Workload

MODEL = "prism-small-qwen2vl"
HOT_IMAGES = 4
FIGURES = ("encoder_cache_hot_cold_ttft_ratio", "encoder_hit_rate_2_replicas", "prefix_reuse_fraction")


def app_config(config: dict[str, Any], model: str = MODEL) -> dict[str, Any]:
    """The bench's Prism config on ``model`` with two encode and two prefill replicas (CPU shares: 0.25 × 6 < 2)."""
    two = {"num_cpus": 0.25, "min_replicas": 2, "max_replicas": 2}
    return {
        **config,
        "model": {**config["model"], "model": model},
        "deployments": {**config["deployments"], "encode": two, "prefill": two},
    }


def hot_workload(seed: int) -> Workload:
    return Workload(
        mix={"image": 1},
        sizes={"medium": 1},
        cache="hot",
        hot_images=HOT_IMAGES,
        fresh_questions=True,
        outputs=OutputLengths("fixed:16"),
        seed=seed,
    )


def prime(url: str, model: str, workload: Workload) -> None:
    """Ask each hot image once (untimed), so the timed load measures repeats only."""
    with httpx.Client(timeout=120) as http:
        for image in workload.hot_set("medium"):
            content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Prime."}]
            body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            r = http.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            r.raise_for_status()


def hit_rate(records: list[RequestRecord]) -> float | None:
    """Encoder-cache hits per media item over the ok requests' traces."""
    hits = misses = 0
    for r in records:
        if r.ok and r.trace:
            enc = r.trace["cache"]["encoder"]
            hits, misses = hits + enc["hits"], misses + enc["misses"]
    return hits / (hits + misses) if hits + misses else None


def prefix_reuse(records: list[RequestRecord]) -> float | None:
    """Visual tokens found in the prefix cache / visual tokens, over the ok requests' traces."""
    cached = visual = 0
    for r in records:
        if r.ok and r.trace:
            cached += r.trace["cache"]["prefix"]["cached_visual_tokens"]
            visual += r.trace["visual_tokens"]
    return cached / visual if visual else None


def replicas_used(records: list[RequestRecord], stage: str) -> dict[str, int]:
    """Requests per replica of ``stage`` (from the routing decisions in the traces)."""
    out: dict[str, int] = {}
    for r in records:
        route = (r.trace or {}).get("cache", {}).get("routing", {}).get(stage)
        if route:
            out[route["replica"]] = out.get(route["replica"], 0) + 1
    return out


def measure(url: str, model: str, runs: int, duration: float, say) -> tuple[list, list]:
    """(cold loads, hot loads), one of each per run, interleaved."""
    cold, hot = [], []
    for i in range(runs):
        say(f"cache reach ({model}, 2 encode + 2 prefill replicas), run {i + 1}: cold, primed, hot")
        s = loads.seed_of("cache_cold", i)
        cold.append(loads.load(url, model, loads.medium("cold", s), 0.5, duration, seed=s))
        s = loads.seed_of("cache_hot", i)
        prime(url, model, hot_workload(s))
        hot.append(loads.load(url, model, hot_workload(s), 0.5, duration, seed=s))
    return cold, hot


def figures(model: str, cold: list[list[RequestRecord]], hot: list[list[RequestRecord]]) -> dict[str, Any]:
    per_run = [
        {
            "hot_ttft_p50_s": loads.ttft(h),
            "cold_ttft_p50_s": loads.ttft(c),
            "hot_stage_ms_mean": loads.stages(h),
            "cold_stage_ms_mean": loads.stages(c),
            "encoder_hit_rate": hit_rate(h),
            "prefix_reuse_fraction": prefix_reuse(h),
            "encode_requests_per_replica": replicas_used(h, "encode"),
            "prefill_requests_per_replica": replicas_used(h, "prefill"),
        }
        for h, c in zip(hot, cold, strict=True)
    ]
    sides = {"hot": [r for h in hot for r in h], "cold": [r for c in cold for r in c]}
    where = f"{model}, 2 encode + 2 prefill replicas, {HOT_IMAGES} hot images asked new questions"
    return {
        "encoder_cache_hot_cold_ttft_ratio": record(
            "encoder_cache_hot_cold_ttft_ratio",
            [loads.ratio(loads.ttft(h), loads.ttft(c)) for h, c in zip(hot, cold, strict=True)],
            per_run,
            note=where,
            sides=sides,
        ),
        "encoder_hit_rate_2_replicas": record(
            "encoder_hit_rate_2_replicas",
            [hit_rate(h) for h in hot],
            [{"encode_requests_per_replica": p["encode_requests_per_replica"]} for p in per_run],
            note=where,
            sides={"hot": sides["hot"]},
        ),
        "prefix_reuse_fraction": record(
            "prefix_reuse_fraction",
            [prefix_reuse(h) for h in hot],
            [{"prefill_requests_per_replica": p["prefill_requests_per_replica"]} for p in per_run],
            note=where + "; visual tokens found in the prefix cache / visual tokens",
            sides={"hot": sides["hot"]},
        ),
    }
