"""The servers ``make bench`` measures, one at a time on 127.0.0.1: Prism on a Ray cluster of its own, and the
baselines (the monolith, the naive server) as subprocesses whose output is kept under :data:`LOGS`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
KEY, ALPHA, BETA, GAMMA = "bench-key", "bench-alpha", "bench-beta", "bench-gamma"
"""API keys of the Prism runs: tenant ``bench`` for the single-tenant figures, ``alpha`` / ``beta`` for the
tenant figure, ``gamma`` too for the three-tenant one (the monolith and the naive server ignore keys)."""


def wait_ready(base: str, timeout: float = 180.0, key: str = KEY) -> None:
    """Until ``base``'s ``/v1/models`` answers 200 (asked with ``key``: Prism's configs have keys, the baselines
    ignore it); ``RuntimeError`` after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            auth = {"Authorization": f"Bearer {key}"}
            if httpx.get(f"{base}/v1/models", headers=auth, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} did not come up")


LOGS = ROOT / "loadtest" / "results" / "logs"
"""The baselines' stdout and stderr, one file per server per run (not committed)."""


@contextmanager
def subprocess_server(module: str, args: list[str]):
    port = free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{module.rsplit('.', 1)[-1]}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_ready(f"http://127.0.0.1:{port}")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its output: {log_path}") from None
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def ray_start_env() -> dict[str, str]:
    """What a local cluster of the bench's (and ``make chaos``'s) needs in its environment: the stages' niceness
    reaches the cores (services/platform/priority.py), and HAProxy is at the front door, as ``make serve`` runs it
    (services/platform/front_door.py)."""
    from services.platform import front_door
    from services.platform.priority import worker_env

    return {**worker_env(), **front_door.env()}


@contextmanager
def prism_app(config: dict[str, Any], key: str = KEY):
    """Prism's application of ``config`` on a local Ray cluster of this process (its workers at Prism's niceness),
    answering ``/v1/models`` to ``key``; yields its ``…/v1`` URL and takes the cluster down after."""
    import ray
    from ray import serve

    from services.app import build_app

    port = free_port()
    os.environ.update(ray_start_env())
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"config": config}), name="prism", route_prefix="/")
        wait_ready(f"http://127.0.0.1:{port}", key=key)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def write_config(config: dict[str, Any]) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(config, f)
    f.close()
    return f.name
