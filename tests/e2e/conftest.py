"""A real local Ray cluster running the Prism Serve application, on 127.0.0.1, shared by the e2e tests.

Package-scoped: the cluster (and its background threads in this process) is gone before the unit and security
tests run, so their monkeypatching of global functions cannot race with Ray's own threads.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.netutil import free_port

GRPC_SERVICER = "services.proto.prism_pb2_grpc.add_PrismServicer_to_server"
API_KEY = "test-key-a"
QWEN = "prism-tiny-qwen2vl"
OTHER_KEY = "test-key-b"


@pytest.fixture(scope="package")
def otlp_receiver():
    """A real OTLP/HTTP trace receiver the app exports its spans to (``observability.otlp_endpoint``)."""
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def prism_server(model_cache, tmp_path_factory, otlp_receiver):
    """(base_url, config) of a deployed app; its media stage may fetch from 127.0.0.1 — opened through the
    environment variable in the cluster's processes only, never in this test process."""
    import ray
    from ray import serve

    from common.model.builder import resolve_model_dir
    from services.app import build_app

    resolve_model_dir("prism-tiny-llava", model_cache)  # build once here, not in five replicas at once
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    request_log = tmp_path_factory.mktemp("logs") / "requests.jsonl"
    stage = {"num_cpus": 0.1}
    config = {
        "model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1},
        "engine": {"kv_pool_blocks": 256, "max_output_tokens": 256},
        "server": {
            "api_keys": {API_KEY: "tenant-a", OTHER_KEY: "tenant-b"},
            "retry_after_s": 2,
            "max_in_flight_per_ingress": 4,
        },
        "deployments": {
            "ingress": {"num_cpus": 0.1, "max_ongoing_requests": 16, "max_queued_requests": 16},
            "media": stage,
            "encode": stage,
            "prefill": stage,
            "decode": stage,
        },
        "observability": {
            "request_log_path": str(request_log),
            "trace_cache_hits": True,
            "otlp_endpoint": otlp_receiver.endpoint,
        },
    }
    from common.config import PrismConfig
    from services.platform.proxy_guard import cluster_env

    saved = dict(os.environ)
    # Inherited by the proxy actor: the body bounds; not the keys — this cluster serves more apps than this one, with
    # keys of their own, and the proxy would mistake them for this one's (their ingresses authenticate every request).
    os.environ.update(cluster_env([("prism", "/", PrismConfig.model_validate(config))], verify_keys=False))
    ray.init(
        address="local",  # always a fresh cluster of our own, even if another one runs on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},  # metrics reach the endpoint within ~1 s
        runtime_env={"env_vars": {"PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS": "127.0.0.1/32", "RAY_AUTH_MODE": "disabled"}},
    )
    os.environ.clear()
    os.environ.update(saved)
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    serve.run(build_app({"config": config}), name="prism", route_prefix="/")  # before _grpc_port is added
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    config["_grpc_port"] = grpc_port
    config["_metrics_url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    config["_request_log"] = str(request_log)
    yield base, config
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def nixl_base(prism_server, model_cache):
    """Base URL of a second application in the same cluster whose visual embeddings and KV go through NIXL (UCX): two
    models, LLaVA (by ``server.transport``) and Qwen2-VL (by its own ``transport``). Module-scoped: its replicas'
    NIXL agents, and their memory, are not kept for the modules after the one that uses it."""
    from ray import serve

    from common.model.builder import resolve_model_dir
    from services.app import build_app

    base, config = prism_server
    resolve_model_dir(QWEN, model_cache)
    stages = {s: config["deployments"][s] for s in ("media", "encode", "prefill", "decode")}
    nixl = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("model", "deployments")}
    nixl["server"] = {**config["server"], "transport": "nixl"}
    nixl["deployments"] = {"ingress": config["deployments"]["ingress"]}
    qwen = {"model": QWEN, "cache_dir": model_cache, "torch_threads": 1, "transport": "nixl"}
    nixl["models"] = [{**config["model"], "deployments": stages}, {**qwen, "deployments": stages}]
    serve.run(build_app({"config": nixl}), name="prism-nixl", route_prefix="/nixl")
    yield f"{base}/nixl"
    serve.delete("prism-nixl")


@pytest.fixture(scope="package")
def decode_stats(prism_server):
    from ray import serve

    handle = serve.get_deployment_handle("Decode", app_name="prism")
    return lambda: handle.stats.remote().result(timeout_s=30)


@pytest.fixture(scope="package")
def client(prism_server):
    import openai

    base, _ = prism_server
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
