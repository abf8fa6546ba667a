"""The application as a user starts it: ``make serve`` with the default Serve config (``ray_configs/local_cpu.yaml``).

It runs in its own processes (``make serve`` starts a Ray head and ``serve run``), so nothing of Ray runs in the
pytest process (other tests there monkeypatch global functions). Only the ports, the model cache, an API key and a
request-log file differ from the default config. The test packages that use it start it package-scoped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.netutil import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sec-key-a"
OTHER_KEY = "sec-key-b"
"""A second tenant's key (``tenant-b``): the victim of another tenant's hostile requests."""
ORIGIN_KEY = "sec-key-c"
"""A third tenant's key (``tenant-c``): requests for media on origins that never answer — the one place a hostile
request's typed answer is a 5xx (504 ``media_fetch_timeout``: the origin's fault, retryable), kept apart so that every
other request can be held to "no 5xx"."""
UPSTREAM_TIMEOUTS = {(504, "media_fetch_timeout"), (504, "deadline_exceeded")}
"""What a request for media on an origin that never answers may end in."""


def server_errors(request_log: Path) -> list[dict]:
    """The request log's 5xx lines, but for ``tenant-c``'s upstream timeouts (:data:`UPSTREAM_TIMEOUTS`)."""
    lines = [json.loads(line) for line in request_log.read_text().splitlines()]
    return [x for x in lines if x["status"] >= 500 and not _upstream_timeout(x)]


def _upstream_timeout(line: dict) -> bool:
    return line["tenant"] == "tenant-c" and (line["status"], line["code"]) in UPSTREAM_TIMEOUTS


@contextlib.contextmanager
def make_serve(
    model_cache: str,
    work: Path,
    private_media: str = "",
    topology: dict[str, str] | None = None,
    in_ingress: frozenset[str] = frozenset(),
):
    """Yields a dict: ``base`` URL, ``grpc`` and ``metrics`` ports, ``request_log`` path, ``log`` (make serve's
    output), ``config`` (the application's PrismConfig dict), ``up_s`` (launch → /health answering), ``ray_port`` and
    ``dashboard`` (the URL of Ray's dashboard / job / Serve REST API).
    ``private_media``: CIDRs the media stage may fetch from (``PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS``, e.g. a test's own
    origin on loopback). ``topology``: a model's ``deployments.topology`` in the config, by model name; ``in_ingress``:
    the models served in the ingress replica (``deployments.in_ingress``, with ``topology: MEPD``)."""
    http, grpc_port, metrics, ray_port, dashboard = free_port(), free_port(), free_port(), free_port(), free_port()
    config = yaml.safe_load((ROOT / "ray_configs" / "local_cpu.yaml").read_text())
    config["http_options"]["port"] = http
    config["grpc_options"]["port"] = grpc_port
    app = config["applications"][0]["args"]["config"]
    for model in app.get("models") or [app.setdefault("model", {})]:
        model["cache_dir"] = model_cache
        if topology and model["model"] in topology:
            model.setdefault("deployments", {})["topology"] = topology[model["model"]]
        if model["model"] in in_ingress:
            model.setdefault("deployments", {})["in_ingress"] = True
    app["server"] = {"api_keys": {API_KEY: "tenant-a", OTHER_KEY: "tenant-b", ORIGIN_KEY: "tenant-c"}}
    app["observability"] = {"request_log_path": str(work / "requests.jsonl"), "trace_cache_hits": True}
    cfg = work / "serve.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = work / "make-serve.log"
    flags = f"--metrics-port {metrics} --ray-port {ray_port} --dashboard-port {dashboard}"
    cmd = ["make", "serve", f"CONFIG={cfg}", f"SERVE_FLAGS={flags}"]
    started = time.monotonic()
    env = {**os.environ, "PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS": private_media} if private_media else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=out, stderr=subprocess.STDOUT, env=env)
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
            "pid": proc.pid,  # make's; it leads the session its children run in
            "ray_port": ray_port,
            "dashboard": f"http://127.0.0.1:{dashboard}",
            "serve_config": cfg,  # (the Serve config file make serve deployed)
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
    while ray_processes() and time.time() < deadline:  # the CLI's `ray stop` may still be at work
        time.sleep(1)
    if ray_processes():
        subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "stop", "--force"], check=False)


def serving_pids(session: int) -> list[int]:
    """Every process of a ``make serve``: those of its session (make, the CLI, ``serve run``) and every process of
    the Ray head it started — ``ray start`` daemons, workers, Ray's helpers, wherever they were reparented — which
    all inherit ``ray start``'s environment, marked by ``PRISM_REPLICA_GRPC_HOST`` (another Ray on this machine,
    started without it, is not this app's)."""
    from services.platform.loopback import ENV_REPLICA_GRPC_HOST

    marker = f"{ENV_REPLICA_GRPC_HOST}=".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            sid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if sid == session or any(v.startswith(marker) for v in env.split(b"\0")):
            found.append(int(pid))
    return found


def ray_processes() -> list[tuple[int, str, int]]:
    """``(pid, name, RSS in MB)`` of every Ray process on this machine: workers by their title without ``ray::``
    (``ServeReplica:prism:Ingress``, ``ProxyActor`` …), the raylet and GCS by their executable's path."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if title.startswith("ray::") or "raylet" in title or "gcs_server" in title:
            rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0)
            name = title.split(" ")[0]
            if name.startswith("ray::"):  # an actor busy in a method is titled `<actor>.<method>`
                name = name.removeprefix("ray::").split(".", 1)[0]  # (actor and deployment names hold no '.')
            found.append((int(pid), name, rss // 1024))
    return found


def serve_processes() -> dict[str, tuple[int, int]]:
    """Serve's proxy and replicas: name → (pid, RSS in MB); a changed pid is a restarted process."""
    return {name: (pid, rss) for pid, name, rss in ray_processes() if name.startswith(("ProxyActor", "ServeReplica"))}


def assert_hops(trace: dict, topology: str, media: bool) -> None:
    """A traced answer's hand-offs went where ``topology`` puts them: in process between stages of one group, through
    the object store between deployments."""
    from common.config.topology import group_of

    spans = {s["name"]: s.get("attrs", {}) for s in trace["spans"]}

    def backend(a: str, b: str) -> str:
        return "in_process" if b in group_of(topology, a) else "object_store"

    assert spans["decode.transfer"]["backend"] == backend("prefill", "decode")
    # the KV was reserved before prefill (by the ingress, or in a group's own replica) where the stream then ran
    route = trace["cache"]["routing"]["decode"]
    assert route["outcome"] in ("reserved", "waited") and route["replica"] == spans["decode.transfer"]["replica"], route
    if media:
        assert spans["prefill.transfer"]["backend"] == backend("encode", "prefill")
