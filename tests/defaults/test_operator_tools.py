"""Ray's own operator tools against a running ``make serve``, whose head serves Ray's dashboard, job and Serve REST
API on loopback: ``serve status`` lists the deployments, ``serve deploy`` of a changed config applies (in place: no
replica restarts, the API answers throughout), and ``ray job submit`` runs the offline batch on that head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from tests.mediakit import video_bytes
from tests.paths import ROOT
from tests.served import API_KEY

BIN = Path(sys.executable).parent


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _applications(served) -> dict:
    return httpx.get(f"{served['dashboard']}/api/serve/applications/", timeout=30).json()["applications"]


def test_serve_status_lists_the_deployments(served):
    done = _cli("serve", "status", "--address", served["dashboard"])
    assert done.returncode == 0, done.stderr[-2000:]
    app = yaml.safe_load(done.stdout)["applications"]["prism"]
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
