"""The chart secure by default, checked on its rendered manifests (``tests/helm/chart.py``, the ``rendered``
fixture): unsafe values refused by the chart itself (no API keys without ``auth.allowAnonymous``, RDMA without NIXL);
Ray token authentication; a NetworkPolicy confining Ray's ports to the release; every container hardened (non-root,
no privilege escalation, no capabilities but IPC_LOCK for NIXL over RDMA, seccomp, read-only root); API keys mounted
only where the ingress runs.
"""

from __future__ import annotations

import json
import re

import helm_python
import kubernetes_validate
import pytest

from common.config import PrismConfig
from tests.helm.chart import K8S_VERSION, one, render, serve_config


def _groups(docs: list[dict]) -> dict[str, dict]:
    """Pod spec of each group: ``head`` and the worker groups by name."""
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    out.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return out


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}


def _keys_mounted(pod: dict) -> bool:
    return any(v["name"] == "api-keys" for v in pod.get("volumes", []))


def test_api_keys_from_values_become_a_secret_mounted_where_a_proxy_checks_them():
    values = {"auth": {"keys": {"sk-one": "tenant-a"}}}
    docs = render(values)
    secret = one(docs, "Secret")
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert json.loads(secret["stringData"]["api-keys.json"]) == {"sk-one": "tenant-a"}
    serve = serve_config(docs)
    assert "sk-one" not in json.dumps(serve)  # keys never enter the Serve config
    config = serve["applications"][0]["args"]["config"]
    assert config["server"]["api_keys_file"] == "/etc/prism/auth/api-keys.json"
    assert PrismConfig.model_validate(config).deployments.ingress.resources == {"prism_media": 1}
    pods = _groups(docs)
    # every pod runs a Serve proxy (proxy_location EveryNode), which checks the key before it reads a body
    assert serve["proxy_location"] == "EveryNode"
    assert {g for g, pod in pods.items() if _keys_mounted(pod)} == {"head", "media", "encode", "prefill", "decode"}
    assert {"name": "api-keys", "secret": {"secretName": secret["metadata"]["name"]}} in pods["media"]["volumes"]
    guard = json.loads(_env(pods["head"])["PRISM_PROXY_GUARD"])
    assert guard["routes"] == [
        {"app": "prism", "prefix": "/", "digests": {}, "keys_file": "/etc/prism/auth/api-keys.json", "reload_s": 5.0}
    ]
    assert "sk-one" not in json.dumps(guard)


def test_default_render_is_authenticated_by_a_secret_the_operator_creates():
    docs = render()
    assert not [d for d in docs if d["kind"] == "Secret"]  # referenced by name, not created
    config = serve_config(docs)["applications"][0]["args"]["config"]
    assert config["server"]["api_keys_file"] == "/etc/prism/auth/api-keys.json"
    assert _groups(docs)["media"]["volumes"][-1] == {"name": "api-keys", "secret": {"secretName": "prism-api-keys"}}
    assert PrismConfig.model_validate(config).observability.trace_cache_hits is False  # no cache side channel


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"auth": {"existingSecret": ""}}, "auth: no API keys. Set auth.existingSecret"),
        ({"auth": {"existingSecret": "", "keys": {}}}, "or auth.keys to let the chart create it"),
        ({"auth": {"allowAnonymous": True, "keys": {"sk": "a"}}}, "set one or the other"),
        ({"rdma": {"enabled": True}}, "rdma.enabled needs transport: nixl"),
    ],
    ids=["no-secret", "empty-keys", "anonymous-with-keys", "rdma-without-nixl"],
)
def test_unsafe_values_fail_to_render_with_the_reason(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=message.replace(".", r"\.")):
        render(values)


def test_anonymous_access_only_when_asked_for():
    docs = render({"auth": {"allowAnonymous": True}})
    config = PrismConfig.model_validate(serve_config(docs)["applications"][0]["args"]["config"])
    assert config.server.api_keys_file is None and config.server.api_keys == {}
    assert not any(_keys_mounted(pod) for pod in _groups(docs).values())


def test_ray_token_authentication_is_on(rendered):
    _, _, docs = rendered
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # KubeRay generates the token Secret
    given = one(render({"rayAuth": {"mode": "token", "secretName": "ray-token"}}), "RayService")
    assert given["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    off = one(render({"rayAuth": {"mode": "disabled"}}), "RayService")
    assert "authOptions" not in off["spec"]["rayClusterConfig"]


HARDENED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_every_container_is_hardened(rendered):
    name, _, docs = rendered
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    contexts = {"autoscaler": cluster["autoscalerOptions"]["securityContext"]}
    for group, pod in _groups(docs).items():
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 100,
            "fsGroup": 100,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (container,) = pod["containers"]
        contexts[group] = container["securityContext"]
        # the root filesystem is read-only: Ray's session dir and the caches are writable volumes
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "tmp" and mounts["/var/cache/prism"] == "cache" and mounts["/dev/shm"] == "shm"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes["tmp"] and "emptyDir" in volumes["cache"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        writable = {path for path, vol in mounts.items() if vol in ("tmp", "cache")}
        for var in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):
            assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), (group, var)
        # where every served model writes (its contract; a model built from a name), as the replica resolves it
        config = PrismConfig.model_validate(serve_config(docs)["applications"][0]["args"]["config"])
        for sub in config.served():
            cache = sub.model.cache_dir.replace("~", env["HOME"], 1) if sub.model.cache_dir.startswith("~") else None
            cache = cache or sub.model.cache_dir
            assert any(cache.startswith(w + "/") for w in writable), (group, sub.model.name, cache)
    for where, ctx in contexts.items():
        assert HARDENED.items() <= ctx.items(), where
        assert ctx["capabilities"]["drop"] == ["ALL"], where
        # IPC_LOCK only where NIXL may register memory for RDMA: the GPU stages of the RDMA example
        ipc_lock = name == "gpu-multinode" and where in ("encode", "prefill", "decode")
        assert ctx["capabilities"].get("add", []) == (["IPC_LOCK"] if ipc_lock else []), where
    config = PrismConfig.model_validate(serve_config(docs)["applications"][0]["args"]["config"])
    if name == "default":  # the built-in model is built into the writable cache volume
        assert config.model.cache_dir == "/var/cache/prism/models"


def test_nixl_without_rdma_devices_adds_no_capability_and_no_rdma_transports():
    docs = render({"transport": "nixl"})
    for group, pod in _groups(docs).items():
        container = pod["containers"][0]
        assert "add" not in container["securityContext"]["capabilities"], group
        env = {e["name"] for e in container["env"]}
        assert not env & {"UCX_TLS", "UCX_NET_DEVICES"}, group  # UCX picks TCP itself; `rc` would need the devices


def test_network_policy_confines_rays_ports_to_the_release(rendered):
    _, _, docs = rendered
    policy = one(docs, "NetworkPolicy")
    spec = policy["spec"]
    own = {"app.kubernetes.io/name": "prism", "app.kubernetes.io/instance": "prism"}
    assert spec["podSelector"] == {"matchLabels": own} and spec["policyTypes"] == ["Ingress"]
    for pod in one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"] + [
        one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    ]:  # the policy selects every Ray pod
        assert own.items() <= pod["template"]["metadata"]["labels"].items()
    rules = spec["ingress"]
    # every port (Ray's dynamic ones included) only from the release's own pods
    (internal,) = [r for r in rules if "ports" not in r]
    assert internal["from"] == [{"podSelector": {"matchLabels": own}}]
    by_ports = {tuple(p["port"] for p in r["ports"]): r["from"] for r in rules if "ports" in r}
    kuberay = {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    operator_ns = {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}
    operator = [{"namespaceSelector": operator_ns, "podSelector": kuberay}]  # not any namespace: 8265 is the job API
    assert by_ports == {
        (8265,): operator,
        (8000, 9000): [{"podSelector": {}}],
        (8080,): [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }
    assert all(p["protocol"] == "TCP" for r in rules if "ports" in r for p in r["ports"])


def test_an_empty_peer_list_admits_nobody_rather_than_everybody():
    docs = render({"networkPolicy": {"serveFrom": [], "metricsFrom": []}})
    rules = one(docs, "NetworkPolicy")["spec"]["ingress"]
    kubernetes_validate.validate(one(docs, "NetworkPolicy"), K8S_VERSION, strict=True)
    assert all(r.get("from") for r in rules)  # a rule without `from` would admit every source
    assert {tuple(p["port"] for p in r["ports"]) for r in rules if "ports" in r} == {(8265,)}
    ingress_ns = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    rules = one(render({"networkPolicy": {"serveFrom": ingress_ns}}), "NetworkPolicy")["spec"]["ingress"]
    assert [r["from"] for r in rules if r.get("ports", [{}])[0].get("port") == 8000] == [ingress_ns]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def _cpus(topology: str, **per_stage: float) -> dict:
    return {"topology": topology, "stages": {stage: {"serve": {"num_cpus": n}} for stage, n in per_stage.items()}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            _cpus("EPD", encode=4, prefill=4),
            "a replica of the encode-prefill-decode deployment asks 10 CPUs (encode 4 + prefill 4 + decode 2",
        ),
        (  # (KubeRay gives such a pod 2 CPUs: a 2-CPU replica fits, a 2.5-CPU one does not)
            {
                "stages": {
                    "decode": {"serve": {"num_cpus": 2.5}, "workers": {"resources": {"limits": {"cpu": "1500m"}}}}
                }
            },
            "a replica of the decode deployment asks 2.5 CPUs (decode 2.5: serve.num_cpus) but a pod of its worker "
            "group has 2",
        ),
        (
            {
                "topology": "E/PD",
                "stages": {"prefill": {"serve": {"num_gpus": 0.5}}, "decode": {"serve": {"num_gpus": 1.5}}},
            },
            "a replica of the prefill-decode deployment asks 1.5 GPUs",
        ),
        ({"stages": {"ingress": {"serve": {"num_cpus": 20}}}}, "a replica of the ingress deployment asks 20 CPUs"),
        (
            {"topology": "E/PD", "stages": {"prefill": {"serve": {"num_gpus": 2}}}},
            "a replica of the prefill-decode deployment asks 2 GPUs (serve.num_gpus) but a pod of its worker group "
            "has 1",
        ),
        (  # (media's CPUs count in the group that holds it)
            {"topology": "MEPD"},
            "a replica of the media-encode-prefill-decode deployment asks 10 CPUs (media 4 + encode 2 + prefill 2 + "
            "decode 2: serve.num_cpus) but a pod of its worker group has 8",
        ),
        (  # (the ingress runs on the group that holds media: checked against its pods there too)
            {"topology": "ME/PD", "stages": {"ingress": {"serve": {"num_cpus": 20}}}},
            "stages.encode.workers: a replica of the ingress deployment asks 20 CPUs",
        ),
    ],
    ids=[
        "group-cpus",
        "millicpus",
        "fractional-gpus",
        "ingress-on-media",
        "group-gpus",
        "media-group-cpus",
        "ingress-on-media-encode",
    ],
)
def test_a_deployment_that_cannot_fit_a_pod_of_its_group_fails_to_render(values, message):
    """Serve would wait for such a replica forever without an error: the chart says which and why instead."""
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(values)


def test_a_replica_that_fits_a_pod_as_kuberay_counts_it_renders():
    """A '1500m' pod is 2 CPUs to Ray (KubeRay rounds up): the default 2-CPU decode replica fits it."""
    render({"stages": {"decode": {"workers": {"resources": {"limits": {"cpu": "1500m"}, "requests": {"cpu": "1"}}}}}})
