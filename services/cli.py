"""Prism command line.

* ``python -m services.cli serve [--config ray_configs/local_cpu.yaml]`` — starts a local Ray head (Prometheus
  metrics export on port 8080), builds the configured model if needed, deploys the application with ``serve run``
  and serves until interrupted; then stops the head it started. This is ``make serve``. The head listens on
  loopback only (GCS, raylet, object manager, workers and each Serve replica's gRPC server, client server,
  metrics, and Ray's dashboard / job / Serve REST API on port 8265, where ``serve status``, ``serve deploy`` and
  ``ray job submit`` reach it); the HTTP and gRPC proxies listen on the Serve config's ``http_options.host``
  (127.0.0.1 in the local configs; see :mod:`services.platform.loopback`): that is why Ray's token authentication
  can stay off here (``RAY_AUTH_MODE`` from the environment still wins).
* ``python -m services.cli demo [--model NAME] [--images N] [--repeat K]`` — loads (building if needed) a model and
  runs requests through every stage in this process, printing the answer and per-stage timings (median of K runs);
  needs no Ray cluster (``make demo``).
* ``python -m services.cli build-model NAME [--out DIR]`` — builds an embedded model directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common.config import EngineConfig, ModelConfig
from common.media.synthetic import synthetic_image
from common.model.builder import EMBEDDED_MODELS, build_embedded_model, resolve_model_dir
from common.model.loader import load_model
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request


def _demo(args: argparse.Namespace) -> int:
    lm = load_model(
        ModelConfig(model=args.model, cache_dir=args.cache_dir, dtype=args.dtype, torch_threads=args.threads)
    )
    sizes = [(640, 480), (320, 240), (800, 600), (256, 256)]
    images = [synthetic_image(*sizes[i % len(sizes)], seed=i) for i in range(args.images)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Describe the image."}]
    messages = [{"role": "user", "content": content}]
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    runs = [run_request(lm, messages, images, sampling, EngineConfig()) for _ in range(args.repeat)]
    stages = list(runs[0].timings.seconds)
    median_ms = {s: round(1000 * statistics.median(r.timings.seconds[s] for r in runs), 2) for s in stages}
    report = {
        "model": lm.served_name,
        "family": lm.contract.family,
        "dtype": lm.contract.dtype,
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "images": args.images,
        "prompt_tokens": len(runs[0].prompt_token_ids),
        "output_tokens": len(runs[0].output.token_ids),
        "median_stage_ms": median_ms,
        "decode_ms_per_token": round(median_ms["decode"] / max(1, len(runs[0].output.token_ids)), 3),
        "text": runs[0].output.text,
        "contract": lm.contract.model_dump(),
    }
    print(json.dumps(report, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess

    import yaml

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM takes the same path as Ctrl-C: stop serving, stop the head we started

    signal.signal(signal.SIGTERM, interrupt)

    from services.platform.proxy_guard import cluster_env, serve_apps

    raw = yaml.safe_load(open(args.config))
    apps = serve_apps(raw)  # every application's config validated: a bad one fails here, before Ray starts
    for _, _, cfg in apps:
        for sub in cfg.served():  # built here once, not by every replica at once
            print(f"model {sub.model.name}: {resolve_model_dir(sub.model.model, sub.model.cache_dir)}", flush=True)
    # The proxies guard the front door before the ingress sees a byte — body bounds, and the keys of every application
    # of this config (services/platform/proxy_guard.py); they inherit this environment from the head.
    env = {**os.environ, **cluster_env(apps)}  # (and HAProxy in the proxy's place: services/platform/front_door.py)
    env.update(loopback_env(raw))
    # Safe with the local configs: Ray listens on loopback only, and so do the proxies (http_options.host 127.0.0.1)
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    bindir = Path(sys.executable).parent  # the ray/serve CLIs of this environment, whatever PATH says
    ray, serve = str(bindir / "ray"), str(bindir / "serve")
    start = [
        ray,
        "start",
        "--head",
        f"--port={args.ray_port}",
        "--node-ip-address=127.0.0.1",
        f"--metrics-export-port={args.metrics_port}",
        "--disable-usage-stats",
        # Ray's dashboard, job and Serve REST API on loopback: `serve status`, `serve deploy`, `ray job submit` and the
        # dashboard work against this head as Ray documents, reachable from this machine only
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={args.dashboard_port}",
    ]
    started = subprocess.run(start, env=env, check=False).returncode == 0
    if not started:
        print(
            "ray start failed (is a head already running?); deploying to the existing cluster — its listeners are "
            "whatever that head was started with, not make serve's loopback-only ones",
            flush=True,
        )
    if started:
        env["RAY_ADDRESS"] = f"127.0.0.1:{args.ray_port}"  # the head we started, whatever else runs here
    try:
        return subprocess.run([serve, "run", args.config], env=env, check=False).returncode
    except KeyboardInterrupt:
        return 0
    finally:
        if started:
            subprocess.run([ray, "stop"], env=env, check=False)


def loopback_env(serve_config: dict) -> dict[str, str]:
    """Environment of a ``ray start --head`` whose every listener is on loopback.

    ``--node-ip-address=127.0.0.1`` alone is not enough: Ray swaps a loopback node address for the machine's
    routable one (``services.resolve_ip_for_localhost``) and then listens on it — GCS on every interface. With
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray takes the node for a single-machine cluster (what it does on macOS and
    Windows by default): its address stays 127.0.0.1 and every Ray server binds it. No other node can join, which
    is what a local ``make serve`` wants. Each replica's inter-deployment gRPC server binds the node address too, and
    Serve's gRPC proxy the HTTP proxy's host (:mod:`services.platform.loopback`)."""
    from services.platform.loopback import ENV_GRPC_HOST, ENV_REPLICA_GRPC_HOST

    host = (serve_config.get("http_options") or {}).get("host") or "127.0.0.1"  # Serve's own default host
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", ENV_REPLICA_GRPC_HOST: "127.0.0.1", ENV_GRPC_HOST: str(host)}


def _build(args: argparse.Namespace) -> int:
    path = build_embedded_model(args.name, args.out) if args.out else resolve_model_dir(args.name, args.cache_dir)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prism", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cache-dir", default=ModelConfig().cache_dir, help="where embedded models are built")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="start a local Ray head and serve the application until interrupted")
    serve.add_argument("--config", default="ray_configs/local_cpu.yaml", help="Serve config YAML")
    serve.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics export port")
    serve.add_argument("--ray-port", type=int, default=6379, help="the Ray head's GCS port")
    serve.add_argument(
        "--dashboard-port", type=int, default=8265, help="Ray's dashboard, job and Serve REST API (on 127.0.0.1)"
    )
    serve.set_defaults(func=_serve)
    demo = sub.add_parser("demo", help="run requests through every stage in-process and print timings")
    demo.add_argument("--model", default=ModelConfig().model, help="embedded model name or HF model directory")
    demo.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    demo.add_argument("--images", type=int, default=1, help="images per request")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--repeat", type=int, default=5, help="requests to run; timings are medians")
    demo.add_argument("--threads", type=int, default=None, help="torch threads")
    demo.set_defaults(func=_demo)
    build = sub.add_parser("build-model", help="build an embedded model directory")
    build.add_argument("name", choices=sorted(EMBEDDED_MODELS))
    build.add_argument("--out", default=None, help="directory to write (default: the model cache)")
    build.set_defaults(func=_build)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
