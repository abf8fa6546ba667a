"""Ray's own operator tools against a running ``make serve``, whose head serves Ray's dashboard, job and Serve REST
API on loopback: ``serve status`` lists the deployments, ``serve deploy`` of a changed config applies (in place: no
replica restarts, the API answers throughout), ``ray job submit`` runs the offline batch on that head, and — under a
steady streaming load — a decode deployment scaled 2 → 1 and then rolled to a changed config loses no request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest
import yaml

from tests.e2e.prometheus import total, wait_for
from tests.mediakit import video_bytes
from tests.paths import ROOT
from tests.served import API_KEY

BIN = Path(sys.executable).parent


def _cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"} | (env or {})
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _applications(served) -> dict:
    return httpx.get(f"{served['dashboard']}/api/serve/applications/", timeout=30).json()["applications"]


def test_serve_status_lists_the_deployments(served):
    # An autoscaling decision the earlier tests' load left in flight shows as UPSCALING / DOWNSCALING until Serve has
    # carried it out (seen once in CI): ask again for up to a minute before the assertions below are read.
    deadline = time.time() + 60
    while True:
        done = _cli("serve", "status", "--address", served["dashboard"])
        assert done.returncode == 0, done.stderr[-2000:]
        app = yaml.safe_load(done.stdout)["applications"]["prism"]
        steady = app["status"] == "RUNNING" and all(d["status"] == "HEALTHY" for d in app["deployments"].values())
        if steady or time.time() > deadline:
            break
        time.sleep(2)
    assert app["status"] == "RUNNING"
    assert "Ingress" in app["deployments"] and len(app["deployments"]) >= 3, app["deployments"]
    assert all(d["status"] == "HEALTHY" for d in app["deployments"].values()), app["deployments"]


def test_serve_deploy_of_a_changed_config_applies_in_place(served):
    before = _applications(served)["prism"]["deployments"]["Ingress"]
    queued = before["deployment_config"]["max_queued_requests"] + 1
    replicas = sorted(r["replica_id"] for r in before["replicas"])
    config = yaml.safe_load(Path(served["serve_config"]).read_text())
    config["applications"][0]["deployments"] = [{"name": "Ingress", "max_queued_requests": queued}]
    changed = Path(served["serve_config"]).with_name("serve-changed.yaml")
    changed.write_text(yaml.safe_dump(config))
    done = _cli("serve", "deploy", str(changed), "--address", served["dashboard"])
    assert done.returncode == 0, done.stderr[-2000:]
    deadline, body = time.time() + 120, {}
    while time.time() < deadline:
        ingress = _applications(served)["prism"]["deployments"]["Ingress"]
        if ingress["deployment_config"]["max_queued_requests"] == queued and ingress["status"] == "HEALTHY":
            break
        time.sleep(1)
    assert ingress["deployment_config"]["max_queued_requests"] == queued, "the changed config applied"
    assert sorted(r["replica_id"] for r in ingress["replicas"]) == replicas, "in place: no replica restarted"
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(f"{served['base']}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


@pytest.mark.timeout(400)
def test_ray_job_submit_runs_the_offline_batch_on_the_head(served, tmp_path, model_cache):
    (tmp_path / "clip.mp4").write_bytes(video_bytes(1.0, fps=4))
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text(json.dumps({"id": "c1", "video": "clip.mp4", "prompt": "What happens?", "max_tokens": 4}))
    config = tmp_path / "batch.yaml"  # (room beside the served replicas: the pipeline's tasks and actors ask little)
    config.write_text(yaml.safe_dump({
        "model": {"model": "prism-tiny-qwen2vl", "cache_dir": model_cache, "torch_threads": 1},
        "batch": {"media_num_cpus": 0.05, "actor_num_cpus": 0.05, "media_concurrency": 1},
    }))  # fmt: skip
    out = tmp_path / "out"
    done = _cli("ray", "job", "submit", "--address", served["dashboard"], "--working-dir", str(ROOT), "--",
                sys.executable, "-m", "services.batch", "--input", str(manifest), "--output", str(out),
                "--config", str(config), timeout=360)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout.lower() and "[prism-batch] summary" in done.stdout
    (row,) = pq.read_table(out / "results.parquet").to_pylist()
    assert (row["id"], row["status"]) == ("c1", "ok") and row["output_tokens"] >= 1


LLAVA_GROUP = "EncodePrefillDecode-prism-tiny-llava"
"""The deployment that holds the tiny LLaVA's decode (``topology: EPD`` in ``make serve``'s config)."""
STALL_S = 10.0
"""The longest a streaming client may wait for a chunk while replicas are replaced (see the rolling test)."""


def _deploy(served, overrides: list[dict], tag: str) -> None:
    config = yaml.safe_load(Path(served["serve_config"]).read_text())
    config["applications"][0]["deployments"] = overrides
    changed = Path(served["serve_config"]).with_name(f"serve-{tag}.yaml")
    changed.write_text(yaml.safe_dump(config))
    done = _cli("serve", "deploy", str(changed), "--address", served["dashboard"])
    assert done.returncode == 0, done.stderr[-2000:]


def _running(served) -> tuple[set[str], str]:
    """The LLaVA group's RUNNING replicas and the deployment's status."""
    group = _applications(served)["prism"]["deployments"].get(LLAVA_GROUP)
    if group is None:  # (while Serve builds the changed application)
        return set(), "BUILDING"
    return {r["replica_id"] for r in group["replicas"] if r["state"] == "RUNNING"}, group["status"]


def _settle(served, done, timeout: float = 180) -> set[str]:
    """Wait until ``done(replicas)`` holds of the group's RUNNING replicas, the deployment HEALTHY."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        replicas, status = _running(served)
        if status == "HEALTHY" and done(replicas):
            return replicas
        time.sleep(0.5)
    raise AssertionError(f"the deployment did not settle: {_running(served)}")


class _Load:
    """Clients streaming long greedy answers from the tiny LLaVA, one request after another, until stopped: each
    request's outcome and the longest wait for its next chunk (its first included)."""

    def __init__(self, served, clients: int = 3) -> None:
        self.oai = openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        self.stop, self.results, self.t0 = threading.Event(), [], time.monotonic()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            messages = [{"role": "user", "content": f"Tell me story number {i}-{n}, a long one."}]
            start = last = time.monotonic()
            ttft, gap, at, finish, error = None, 0.0, 0.0, None, None
            try:
                for chunk in self.oai.chat.completions.create(
                    model="prism-tiny-llava", messages=messages, max_tokens=256, temperature=0, stream=True
                ):
                    now = time.monotonic()
                    if ttft is None:
                        ttft = now - start
                    elif now - last > gap:
                        gap, at = now - last, now - self.t0
                    last = now
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
            except Exception as exc:  # (recorded: the test says which)
                error = f"{type(exc).__name__}: {exc}"
            row = {"finish": finish, "ttft": ttft or 0.0, "gap": gap, "error": error}
            self.results.append(row | {"started": start - self.t0, "gap_at": at})

    def finish(self) -> list[dict]:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        return self.results


def _replicas(n: int, policy: dict) -> dict:
    """The override that sets the group's replicas (its autoscaling policy kept: changing it changes the code
    version, so a second override with the same policy updates in place)."""
    return {"name": LLAVA_GROUP, "autoscaling_config": {"min_replicas": n, "max_replicas": n, "policy": policy}}


def _decode_stats(served) -> dict:
    """The LLaVA group's decode counters (asked through Serve from a process of its own: no Ray in this one)."""
    address = f"127.0.0.1:{served['ray_port']}"
    code = (
        "import json, ray; from ray import serve; "
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
        f"handle = serve.get_deployment_handle({LLAVA_GROUP!r}, app_name='prism'); "
        "print(json.dumps(handle.stats.remote().result(timeout_s=60)))"
    )
    # (a driver of make serve's loopback-only head: Ray must not swap 127.0.0.1 for the machine's address)
    done = _cli("python", "-c", code, timeout=120, env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


@pytest.mark.timeout(600)
def test_a_rolling_update_and_a_scale_down_under_streaming_load_lose_no_request(served):
    """Under a steady streaming load, ``serve deploy`` of a changed config — the LLaVA decode deployment's autoscaling
    overridden, which changes the application's code version: Serve rolls *every* deployment, the ingress included —
    brings the decode deployment to two replicas; a second one scales it back to one (in place). Replacements start
    before the replicas they replace stop (``max_surge_percent``); Serve stops routing to a leaving replica, and the
    ingress lets its streams run ``server.drain_grace_s`` and then moves the rest. Every request ends with a finish
    reason, no client waits ``STALL_S`` for a chunk (its first included), and no KV is held afterwards. Last of the
    module's ``serve deploy`` tests: it leaves the group at one replica."""
    group = _applications(served)["prism"]["deployments"][LLAVA_GROUP]
    before = {r["replica_id"] for r in group["replicas"]}
    policy = group["deployment_config"]["autoscaling_config"]["policy"]
    load = _Load(served)
    try:
        time.sleep(2)
        _deploy(served, [_replicas(2, policy)], "two")
        two = _settle(served, lambda r: len(r) == 2 and not r & before)
        time.sleep(2)
        _deploy(served, [_replicas(1, policy)], "one")
        (kept,) = _settle(served, lambda r: len(r) == 1)
        assert kept in two, "scaled down in place"
        time.sleep(2)
    finally:
        results = load.finish()
    errors = [r["error"] for r in results if r["error"] or not r["finish"]]
    gaps = sorted(max(r["ttft"], r["gap"]) for r in results)
    median = gaps[len(gaps) // 2]
    print(f"[rolling] {len(results)} requests, longest wait for a chunk {gaps[-1]:.2f} s (median {median:.2f} s)")
    for r in sorted(results, key=lambda r: -max(r["ttft"], r["gap"]))[:5]:
        print("[rolling] worst", {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    assert len(results) >= 6 and not errors, errors
    # A request that waited for a replica to start would wait ≥ 20 s here (this rollout settles in ≈ 50 s); the new
    # replicas building their models on the same 2 cores stretch first chunks and chunk waits to 2.9–3.6 s, and to
    # 5.04 s in one CI run: the bound tells the two apart.
    assert gaps[-1] < STALL_S, gaps[-3:]
    stats = _decode_stats(served)
    print(f"[rolling] replica {kept}: {stats}")
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["reserved"] == 0, stats
    # the ingress saw the replica leave (its streams, if any ran on past the grace, moved: prism_migrations_total)
    url = f"http://127.0.0.1:{served['metrics']}/metrics"
    left = "ray_prism_replicas_left_total"
    samples = wait_for(url, lambda s: total(s, left, from_deployment=LLAVA_GROUP) >= 1)
    moved = total(samples, "ray_prism_migrations_total", outcome="resumed")
    gone = total(samples, left, from_deployment=LLAVA_GROUP)
    print(f"[rolling] replicas left: {gone:.0f}, streams moved: {moved:.0f}")
    assert gone >= 1
    # the policy's decision for the group reaches the dashboards' row of each stage it holds
    wanted = "ray_prism_autoscale_desired_replicas"
    for stage in ("encode", "prefill", "decode"):
        samples = wait_for(url, lambda s, stage=stage: total(s, wanted, deployment=LLAVA_GROUP, stage=stage) == 1)
        assert total(samples, wanted, deployment=LLAVA_GROUP, stage=stage) == 1, stage
