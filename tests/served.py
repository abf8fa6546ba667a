"""The application as a user starts it: ``make serve`` with the default Serve config (``ray_configs/local_cpu.yaml``).

It runs in its own processes (``make serve`` starts a Ray head and ``serve run``), so nothing of Ray runs in the
pytest process (other tests there monkeypatch global functions). Only the ports, the model cache, an API key and a
request-log file differ from the default config. The test packages that use it start it package-scoped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.netutil import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sec-key-a"


@contextlib.contextmanager
def make_serve(model_cache: str, work: Path):
    """Yields a dict: ``base`` URL, ``grpc`` and ``metrics`` ports, ``request_log`` path, ``log`` (make serve's
    output), ``config`` (the application's PrismConfig dict) and ``up_s`` (launch → /health answering)."""
    http, grpc_port, metrics, ray_port = free_port(), free_port(), free_port(), free_port()
    config = yaml.safe_load((ROOT / "ray_configs" / "local_cpu.yaml").read_text())
    config["http_options"]["port"] = http
    config["grpc_options"]["port"] = grpc_port
    app = config["applications"][0]["args"]["config"]
    for model in app.get("models") or [app.setdefault("model", {})]:
        model["cache_dir"] = model_cache
    app["server"] = {"api_keys": {API_KEY: "tenant-a"}}
    app["observability"] = {"request_log_path": str(work / "requests.jsonl")}
    cfg = work / "serve.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = work / "make-serve.log"
    cmd = ["make", "serve", f"CONFIG={cfg}", f"SERVE_FLAGS=--metrics-port {metrics} --ray-port {ray_port}"]
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{http}"
        if not wait_for_http(f"{base}/health", proc, 300):
            raise RuntimeError(f"make serve did not come up:\n{log.read_text()[-4000:]}")
        yield {
            "base": base,
            "grpc": grpc_port,
            "metrics": metrics,
            "request_log": work / "requests.jsonl",
            "log": log,
            "config": app,
            "up_s": time.monotonic() - started,
        }
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C's path: SIGTERM to make's process group; the CLI stops the head it started."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.time() + 60
    while _ray_processes() and time.time() < deadline:  # the CLI's `ray stop` may still be at work
        time.sleep(1)
    if _ray_processes():
        subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "stop", "--force"], check=False)


def _ray_processes() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith((b"ray::", b"/")) and (b"raylet" in cmd or b"gcs_server" in cmd or cmd.startswith(b"ray::")):
            found.append(int(pid))
    return found
