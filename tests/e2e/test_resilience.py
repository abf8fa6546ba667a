"""Per-stage autoscaling on queue depth (1 → 2 → 1) and a replica (decode, prefill) killed mid-load: nobody hangs past
the deadline."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.prometheus import total, wait_for

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def scale_base(prism_server):
    from ray import serve

    from services.app import build_app

    base, config = prism_server
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    cfg["deployments"] = {
        **config["deployments"],
        "decode": {
            "num_cpus": 0.1,
            "min_replicas": 1,
            "max_replicas": 2,
            "target_queue_per_replica": 2,
            "downscale_delay_s": 2,
        },
    }
    serve.run(build_app({"config": cfg}), name="prism-scale", route_prefix="/scale")
    yield f"{base}/scale"
    serve.delete("prism-scale")


def _running_decode_replicas() -> int:
    from ray import serve

    dep = serve.status().applications["prism-scale"].deployments["Decode"]
    return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING"))


def _load(base: str, stop: threading.Event, results: list, deadline_ms: int = 20_000) -> None:
    body = {
        "model": "prism-tiny-llava",
        "messages": [{"role": "user", "content": "A long story, please."}],
        "max_tokens": 256,
        "temperature": 0,
    }
    headers = {**HEADERS, "X-Prism-Deadline-Ms": str(deadline_ms)}
    while not stop.is_set():
        start = time.time()
        try:
            code = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        results.append((code, time.time() - start))


def _until(predicate, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def test_decode_scales_up_under_queue_depth_and_back(scale_base, prism_server):
    url = prism_server[1]["_metrics_url"]
    decode = {"application": "prism-scale", "deployment": "Decode"}
    assert _running_decode_replicas() == 1
    stop, results = threading.Event(), []
    workers = [threading.Thread(target=_load, args=(scale_base, stop, results), daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        assert _until(lambda: _running_decode_replicas() == 2, 90), "decode did not scale to 2 replicas"
        # the dashboards' autoscaling picture: the policy's decision and the live replicas, from the metrics
        samples = wait_for(url, lambda s: total(s, "ray_prism_replicas", **decode) == 2)
        assert total(samples, "ray_prism_replicas", **decode) == 2
        assert total(samples, "ray_prism_autoscale_desired_replicas", **decode, stage="decode") == 2
        # the gauge is a point sample of running + waiting sequences, refreshed every few seconds: one scrape can fall
        # between two of the clients' requests (CI saw 0 once), so scrape again while the load runs
        samples = wait_for(url, lambda s: total(s, "ray_prism_stage_queue_depth", **decode) > 0)
        assert total(samples, "ray_prism_stage_queue_depth", **decode) > 0
    finally:
        stop.set()
        for w in workers:
            w.join(90)
    assert _until(lambda: _running_decode_replicas() == 1, 90), "decode did not scale back to 1 replica"
    assert {c for c, _ in results} <= {200, 429}, results
    samples = wait_for(url, lambda s: total(s, "ray_prism_autoscale_desired_replicas", **decode) == 1)
    assert total(samples, "ray_prism_autoscale_desired_replicas", **decode) == 1
    samples = wait_for(url, lambda s: total(s, "ray_prism_replicas", **decode) == 1)  # no stale series of the dead one
    assert total(samples, "ray_prism_replicas", **decode) == 1


@pytest.mark.parametrize("victim", ["Decode", "Prefill"])
def test_killing_a_replica_mid_load_hangs_nobody(scale_base, victim):
    """A decode replica killed under its streams; a prefill replica killed while decode calls wait on its results
    (sent before the prefill finished: services/stages/upstream.py) — they come back as lost hand-offs, re-issued."""
    import ray

    stop, results = threading.Event(), []
    deadline_ms = 8000
    workers = [threading.Thread(target=_load, args=(scale_base, stop, results, deadline_ms)) for _ in range(3)]
    for w in workers:
        w.start()
    time.sleep(3)
    victims = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"prism-scale#{victim}" in a["name"]]
    assert victims, ray.util.list_named_actors(all_namespaces=True)
    ray.kill(ray.get_actor(victims[0]["name"], namespace=victims[0]["namespace"]), no_restart=False)
    time.sleep(6)
    stop.set()
    for w in workers:
        w.join(60)
    assert results
    assert all(elapsed < deadline_ms / 1000 + 5 for _, elapsed in results), results
    assert {c for c, _ in results} <= {200, 429, 503, 504}, results
    # the stage recovers: a fresh request succeeds
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert _until(
        lambda: (
            httpx.post(f"{scale_base}/v1/chat/completions", json=body, headers=HEADERS, timeout=30).status_code == 200
        ),
        60,
    )
