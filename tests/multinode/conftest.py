"""A real multi-node Ray cluster on this machine, shaped and configured the way the Helm chart deploys Prism.

``ray.cluster_utils.Cluster`` starts a head and one node per worker group of the chart's rendered RayService — each
its own raylet with its own small object store, advertising the custom resource its group's ``rayStartParams`` set
(``prism_media``, ``prism_encode``, ``prism_prefill``, ``prism_decode``), the head with no CPUs for replicas as in
the chart — plus a second decode node, so that a decode node can leave while the stage serves on. The applications
are the chart's own ``serveConfigV2`` application, scaled down to this machine (the tiny model, 0.05 CPU and no GPU
per replica, one replica per stage, two of decode in the first app) with every deployment's ``resources`` as
rendered: once with the object-store KV transport in ``E/P/D``, and once with NIXL (over UCX, here on loopback between
nodes) in ``E/PD`` (:data:`TOPOLOGY`).

Package-scoped, and after the e2e package has shut its own cluster down (pytest runs ``tests/e2e`` first). Node death
is detected within ~2 s (GCS health checks every 500 ms) instead of Ray's default ~15 s, so the node-loss test does
not spend its time waiting for Ray to notice.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from tests.netutil import free_port

API_KEY = "multinode-key"
MODEL = "prism-tiny-llava"
APPS = {"object_store": ("mn-store", "/store", 2), "nixl": ("mn-nixl", "/nixl", 1)}
"""transport → (application, route prefix, decode replicas)."""
TOPOLOGY = {"object_store": "E/P/D", "nixl": "E/PD"}
"""transport → the application's topology: the NIXL one groups prefill with decode (on a decode node: a group runs
where its last stage would), so its embeddings cross nodes over NIXL into a replica whose KV hand-off is in process."""
STORE_MB = 96


def chart_cluster_shape() -> tuple[dict, dict[str, dict[str, float]]]:
    """The chart's rendered Serve application config and each worker group's custom resources."""
    from tests.helm.chart import one, render

    spec = one(render(None), "RayService")["spec"]
    app = yaml.safe_load(spec["serveConfigV2"])["applications"][0]
    groups = {
        g["groupName"]: json.loads(json.loads(g["rayStartParams"]["resources"]))
        for g in spec["rayClusterConfig"]["workerGroupSpecs"]
    }
    assert spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    return app["args"]["config"], groups


def scaled_down(config: dict, model_cache: str, transport: str, decode_replicas: int) -> dict:
    """The chart's application for this 2-core machine, in the transport's :data:`TOPOLOGY`; placement
    (``resources``) untouched."""
    cfg = copy.deepcopy(config)
    cfg["deployments"]["topology"] = TOPOLOGY[transport]
    cfg["model"] = {"model": MODEL, "cache_dir": model_cache, "torch_threads": 1}
    cfg["server"] = {"api_keys": {API_KEY: "tenant-mn"}, "transport": transport, "max_chain_attempts": 3}
    cfg["engine"] = {**cfg.get("engine", {}), "kv_pool_blocks": 256, "max_batch": 16, "max_output_tokens": 512}
    for name, d in cfg["deployments"].items():
        if name == "topology":
            continue
        d.update(num_cpus=0.05, num_gpus=0)
        if name != "ingress":
            d.update(min_replicas=1, max_replicas=1)
    cfg["deployments"]["decode"].update(min_replicas=decode_replicas, max_replicas=decode_replicas)
    return cfg


@pytest.fixture(scope="package")
def cluster(model_cache):
    """``(base_url, nodes, cluster)``: ``nodes`` maps a group name (``decode`` and ``decode-2`` for the two decode
    nodes) to its node; the applications are deployed and answering."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from common.model.builder import resolve_model_dir
    from loadtest.bench_servers import wait_ready
    from services.app import build_app

    resolve_model_dir(MODEL, model_cache)  # built once here, not in every replica at once
    app_config, groups = chart_cluster_shape()
    mb = STORE_MB * 2**20
    fast_death = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": mb, "_system_config": fast_death}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:  # (whatever fails on the way up, the cluster's processes go with the fixture)
        nodes = {}
        for group, resources in [*groups.items(), ("decode-2", groups["decode"])]:
            nodes[group] = cluster.add_node(num_cpus=1, resources=resources, object_store_memory=mb)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        for transport, (name, prefix, decode_replicas) in APPS.items():
            cfg = scaled_down(app_config, model_cache, transport, decode_replicas)
            serve.run(build_app({"config": cfg}), name=name, route_prefix=prefix, blocking=False)
        base = f"http://127.0.0.1:{port}"
        for _, prefix, _ in APPS.values():
            wait_ready(f"{base}{prefix}", timeout=300, key=API_KEY)
        yield base, nodes, cluster
    finally:
        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()
        finally:
            cluster.shutdown()


def replicas_by_node(app: str) -> dict[str, list[str]]:
    """Live replica actors of ``app``: deployment name → the node ids they run on (GCS actor table)."""
    from services.platform.drain import serve_replicas

    out: dict[str, list[str]] = {}
    for owner, deployment, node in serve_replicas():
        if owner == app:
            out.setdefault(deployment, []).append(node)
    return out
