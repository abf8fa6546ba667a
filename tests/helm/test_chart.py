"""The KubeRay chart, rendered by real Helm (the Go SDK through ``helm_python``) and validated as a cluster would.

For the default values and the GPU multi-node example: Helm lint passes; every built-in manifest validates against
the Kubernetes schemas (``kubernetes-validate``); the RayService validates against KubeRay's CRD OpenAPI schema
(vendored in ``tests/helm/kuberay``); its ``serveConfigV2`` validates against Ray Serve's own ``ServeDeploySchema``,
builds the Prism application, and — for the GPU example — is the Serve config of ``ray_configs/multi_node.yaml``.
Bad values are refused by ``values.schema.json`` (both by Helm and by jsonschema), unsafe ones by the chart itself
(no API keys without ``auth.allowAnonymous``, RDMA without NIXL). Secure by default, checked on the rendered
manifests: Ray token authentication, a NetworkPolicy confining Ray's ports to the release, every container hardened
(non-root, no privilege escalation, no capabilities but IPC_LOCK for NIXL over RDMA, seccomp, read-only root), API
keys mounted only where the ingress runs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.config import PrismConfig
from common.obs.dashboards import render as render_dashboards

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "prism"
CRDS = Path(__file__).resolve().parent / "kuberay"
GPU_VALUES = yaml.safe_load((CHART / "examples" / "gpu-multinode.yaml").read_text())
K8S_VERSION = "1.30.0"
STAGE_GROUPS = ["media", "encode", "prefill", "decode"]


def _render(values: dict | None = None) -> list[dict]:
    chart = helm_python.Chart.load(str(CHART))
    try:
        out = chart.render(values, name="prism", namespace="serving")
    finally:
        chart.close()
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def _one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _crd_schema(kind_file: str) -> dict:
    crd = yaml.safe_load((CRDS / kind_file).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def _validate_openapi(instance: dict, schema: dict) -> None:
    """KubeRay's OpenAPI v3 schema is JSON Schema plus ``x-kubernetes-*`` hints and ``int-or-string``."""

    def fix(node):
        if isinstance(node, dict):
            node = {k: fix(v) for k, v in node.items()}
            if node.get("x-kubernetes-int-or-string"):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            return node
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    jsonschema.Draft7Validator(fix(schema)).validate(instance)


def _serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(_one(docs, "RayService")["spec"]["serveConfigV2"])


@pytest.fixture(scope="module", params=["default", "gpu-multinode"])
def rendered(request):
    values = None if request.param == "default" else GPU_VALUES
    return request.param, values, _render(values)


def test_helm_lint_passes(rendered):
    _, values, _ = rendered
    result = helm_python.lint(str(CHART), values, strict=True)
    assert result["total_charts_linted"] == 1 and result["errors"] == [], result
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result  # 2 warning, 3 error; 1 is info
    refused = helm_python.lint(str(CHART), {**(values or {}), "transport": "pigeon"}, strict=True)
    assert any("/transport" in e for e in refused["errors"]), refused  # the lint really checks values


def test_builtin_manifests_validate_against_kubernetes_schemas(rendered):
    _, _, docs = rendered
    builtin = [d for d in docs if d["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1")]
    assert {d["kind"] for d in builtin} >= {"ConfigMap", "NetworkPolicy"}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_rayservice_validates_against_the_kuberay_crd(rendered):
    _, _, docs = rendered
    service = _one(docs, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    _validate_openapi(service, _crd_schema("ray.io_rayservices.yaml"))
    # the embedded cluster is also a valid RayCluster spec
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"}}
    cluster["spec"] = service["spec"]["rayClusterConfig"]
    _validate_openapi(cluster, _crd_schema("ray.io_rayclusters.yaml"))
    # every pod template is a valid Kubernetes PodTemplateSpec
    spec = service["spec"]["rayClusterConfig"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_crd_validation_catches_a_broken_spec():
    service = _one(_render(), "RayService")
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        _validate_openapi(service, _crd_schema("ray.io_rayservices.yaml"))


def test_one_worker_group_per_stage_pinned_by_custom_resources(rendered):
    name, _, docs = rendered
    spec = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert "nvidia.com/gpu" not in json.dumps(spec["headGroupSpec"])
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert list(groups) == STAGE_GROUPS
    deployments = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"]).deployments
    for stage, group in groups.items():
        assert f'\\"prism_{stage}\\"' in group["rayStartParams"]["resources"]
        assert getattr(deployments, stage).resources == {f"prism_{stage}": 1}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (stage != "media")
        assert (getattr(deployments, stage).num_gpus > 0) == (stage != "media")
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert deployments.ingress.resources == {"prism_media": 1}
    if name == "gpu-multinode":  # RDMA: devices, IPC_LOCK and UCX settings on the GPU stages only
        for stage, group in groups.items():
            container = group["template"]["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert ("rdma/rdma_shared_device_a" in container["resources"]["limits"]) == (stage != "media")
            assert (env.get("UCX_NET_DEVICES") == "mlx5_0:1") == (stage != "media")


def test_serve_config_is_valid_for_ray_serve_and_builds_the_app(rendered):
    from ray.serve.schema import ServeDeploySchema

    from services.app import build_app
    from tests.unit.test_ray_configs import _deployments

    _, _, docs = rendered
    schema = ServeDeploySchema.model_validate(_serve_config(docs))
    (app,) = schema.applications
    assert app.import_path == "services.app:build_app"
    built = build_app(app.args)
    assert {d.name for d in _deployments(built)} == {"Ingress", "Media", "Encode", "Prefill", "Decode"}


def test_chart_and_ray_configs_describe_the_same_deployments(rendered):
    name, _, docs = rendered
    ours = _serve_config(docs)
    theirs = yaml.safe_load((ROOT / "ray_configs" / "multi_node.yaml").read_text())
    chart_cfg = PrismConfig.model_validate(ours["applications"][0]["args"]["config"])
    file_cfg = PrismConfig.model_validate(theirs["applications"][0]["args"]["config"])
    assert chart_cfg.deployments == file_cfg.deployments
    if name == "gpu-multinode":
        # the same Serve config, except the API-key file the chart mounts from its Secret
        assert chart_cfg.server.api_keys_file == "/etc/prism/auth/api-keys.json"
        server = chart_cfg.server.model_copy(update={"api_keys_file": None})
        assert chart_cfg.model_copy(update={"server": server}) == file_cfg
        strip = {"applications"}
        assert {k: v for k, v in ours.items() if k not in strip} == {k: v for k, v in theirs.items() if k not in strip}


def _containers(docs: list[dict]) -> list[dict]:
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize(
    "prism",
    [
        {},
        {"server": {"max_body_bytes": 5_000_000}},
        {"media": {"max_request_bytes": 1000, "max_items_per_request": 2}, "server": {"max_text_chars": 77}},
    ],
    ids=["defaults", "explicit", "derived"],
)
def test_every_ray_container_bounds_bodies_as_the_config_does(prism):
    from services.proxy_guard import ray_env

    docs = _render({"prism": prism})
    config = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"])
    want = ray_env(config.body_limit)
    for container in _containers(docs):  # every node runs a Serve proxy
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {k: env.get(k) for k in want} == want


def test_a_models_entry_needs_exactly_one_source():
    for entry in ({}, {"name": "a", "path": "b"}, {"name": "a", "extra": 1}):
        with pytest.raises(Exception):  # noqa: B017 (Helm's schema error type is the SDK's own)
            _render({"models": [entry]})


def test_several_models_each_get_their_stages_on_the_stage_groups():
    from services.app import build_app
    from tests.unit.test_ray_configs import _deployments

    values = {"models": [{"name": "prism-tiny-llava"}, {"path": "qwen2-vl-2b", "dtype": "bfloat16", "servedName": "q"}]}
    docs = _render(values)
    app = _serve_config(docs)["applications"][0]
    cfg = PrismConfig.model_validate(app["args"]["config"])
    assert [(m.model, m.dtype, m.name) for m in cfg.models] == [
        ("prism-tiny-llava", "auto", "prism-tiny-llava"),
        ("/models/qwen2-vl-2b", "bfloat16", "q"),
    ]
    for sub in cfg.served():  # every model's stage pinned to its group, the ingress to the media group
        for stage in ("media", "encode", "prefill", "decode"):
            assert getattr(sub.deployments, stage).resources == {f"prism_{stage}": 1}
        assert sub.deployments.ingress.resources == {"prism_media": 1}
    single = {"models": [{"name": "prism-tiny-llava"}, {"name": "prism-tiny-qwen2vl"}]}
    names = {d.name for d in _deployments(build_app(_serve_config(_render(single))["applications"][0]["args"]))}
    assert len(names) == 9 and "Decode-prism-tiny-qwen2vl" in names


def test_monitoring_and_auth_objects(rendered):
    name, _, docs = rendered
    dashboards = _one(docs, "ConfigMap")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["data"] == {k: v.rstrip("\n") for k, v in render_dashboards().items()}
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    if name == "default":
        assert not monitors and not [d for d in docs if d["kind"] == "Secret"]
    else:
        (monitor,) = monitors
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"]
        pods = _one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for group in pods:  # the monitor selects every Ray pod, and each exposes the metrics port
            labels = group["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items()
            ports = group["template"]["spec"]["containers"][0]["ports"]
            assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in ports


def _groups(docs: list[dict]) -> dict[str, dict]:
    """Pod spec of each group: ``head`` and the worker groups by name."""
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    out.update({g["groupName"]: g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    return out


def _keys_mounted(pod: dict) -> bool:
    return any(v["name"] == "api-keys" for v in pod.get("volumes", []))


def test_api_keys_from_values_become_a_secret_mounted_only_where_the_ingress_runs():
    values = {"auth": {"keys": {"sk-one": "tenant-a"}}}
    docs = _render(values)
    secret = _one(docs, "Secret")
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert json.loads(secret["stringData"]["api-keys.json"]) == {"sk-one": "tenant-a"}
    serve = _serve_config(docs)
    assert "sk-one" not in json.dumps(serve)  # keys never enter the Serve config
    config = serve["applications"][0]["args"]["config"]
    assert config["server"]["api_keys_file"] == "/etc/prism/auth/api-keys.json"
    assert PrismConfig.model_validate(config).deployments.ingress.resources == {"prism_media": 1}
    pods = _groups(docs)
    assert {g for g, pod in pods.items() if _keys_mounted(pod)} == {"media"}  # not the head, not the GPU stages
    assert {"name": "api-keys", "secret": {"secretName": secret["metadata"]["name"]}} in pods["media"]["volumes"]
    # without a media group the ingress may land on any worker: every worker group mounts the keys
    docs = _render({**values, "stages": {"media": {"workers": {"enabled": False}}}})
    assert {g for g, pod in _groups(docs).items() if _keys_mounted(pod)} == {"encode", "prefill", "decode"}


def test_default_render_is_authenticated_by_a_secret_the_operator_creates():
    docs = _render()
    assert not [d for d in docs if d["kind"] == "Secret"]  # referenced by name, not created
    config = _serve_config(docs)["applications"][0]["args"]["config"]
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
        _render(values)


def test_anonymous_access_only_when_asked_for():
    docs = _render({"auth": {"allowAnonymous": True}})
    config = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"])
    assert config.server.api_keys_file is None and config.server.api_keys == {}
    assert not any(_keys_mounted(pod) for pod in _groups(docs).values())


def test_ray_token_authentication_is_on(rendered):
    _, _, docs = rendered
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # KubeRay generates the token Secret
    given = _one(_render({"rayAuth": {"mode": "token", "secretName": "ray-token"}}), "RayService")
    assert given["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    off = _one(_render({"rayAuth": {"mode": "disabled"}}), "RayService")
    assert "authOptions" not in off["spec"]["rayClusterConfig"]


HARDENED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_every_container_is_hardened(rendered):
    name, _, docs = rendered
    cluster = _one(docs, "RayService")["spec"]["rayClusterConfig"]
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
        config = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"])
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
    config = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"])
    if name == "default":  # the built-in model is built into the writable cache volume
        assert config.model.cache_dir == "/var/cache/prism/models"


def test_nixl_without_rdma_devices_adds_no_capability_and_no_rdma_transports():
    docs = _render({"transport": "nixl"})
    for group, pod in _groups(docs).items():
        container = pod["containers"][0]
        assert "add" not in container["securityContext"]["capabilities"], group
        env = {e["name"] for e in container["env"]}
        assert not env & {"UCX_TLS", "UCX_NET_DEVICES"}, group  # UCX picks TCP itself; `rc` would need the devices


def test_network_policy_confines_rays_ports_to_the_release(rendered):
    _, _, docs = rendered
    policy = _one(docs, "NetworkPolicy")
    spec = policy["spec"]
    own = {"app.kubernetes.io/name": "prism", "app.kubernetes.io/instance": "prism"}
    assert spec["podSelector"] == {"matchLabels": own} and spec["policyTypes"] == ["Ingress"]
    for pod in _one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"] + [
        _one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
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
    docs = _render({"networkPolicy": {"serveFrom": [], "metricsFrom": []}})
    rules = _one(docs, "NetworkPolicy")["spec"]["ingress"]
    kubernetes_validate.validate(_one(docs, "NetworkPolicy"), K8S_VERSION, strict=True)
    assert all(r.get("from") for r in rules)  # a rule without `from` would admit every source
    assert {tuple(p["port"] for p in r["ports"]) for r in rules if "ports" in r} == {(8265,)}
    ingress_ns = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    rules = _one(_render({"networkPolicy": {"serveFrom": ingress_ns}}), "NetworkPolicy")["spec"]["ingress"]
    assert [r["from"] for r in rules if r.get("ports", [{}])[0].get("port") == 8000] == [ingress_ns]
    assert not [d for d in _render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_a_disabled_worker_group_unpins_its_stage():
    docs = _render({"stages": {"encode": {"workers": {"enabled": False}}}})
    groups = [g["groupName"] for g in _one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert groups == ["media", "prefill", "decode"]
    config = PrismConfig.model_validate(_serve_config(docs)["applications"][0]["args"]["config"])
    assert config.deployments.encode.resources == {} and config.deployments.prefill.resources == {"prism_prefill": 1}


def test_model_from_a_host_path():
    docs = _render({"model": {"source": "hostPath", "hostPath": "/data/models", "path": "qwen2-vl-2b"}})
    config = _serve_config(docs)["applications"][0]["args"]["config"]
    assert config["model"]["model"] == "/models/qwen2-vl-2b"
    spec = _one(docs, "RayService")["spec"]["rayClusterConfig"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}} in template["spec"][
            "volumes"
        ]
        mounts = template["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in mounts


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


BAD_VALUES = {
    "unknown top-level key": {"replicaCount": 3},
    "bad transport": {"transport": "carrier-pigeon"},
    "pvc without a claim": {"model": {"source": "pvc", "path": "m"}},
    "negative worker replicas": {"stages": {"decode": {"workers": {"replicas": -1}}}},
    "typo in a stage's serve settings": {"stages": {"media": {"serve": {"max_replica": 4}}}},
    "transport set inside prism.server": {"prism": {"server": {"transport": "nixl"}}},
    "bad tenant name": {"auth": {"keys": {"k": "no spaces allowed"}}},
    "unknown Ray auth mode": {"rayAuth": {"mode": "password"}},
    "a network peer of an unknown kind": {"networkPolicy": {"serveFrom": [{"everyone": True}]}},
}


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_are_rejected_by_the_schema_and_by_helm(case):
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_values())  # the defaults are valid
    bad = _merge(_values(), BAD_VALUES[case])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)
    with pytest.raises(helm_python.HelmValuesError, match="schema"):
        _render(BAD_VALUES[case])


def test_example_values_are_valid():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_merge(_values(), GPU_VALUES))


def test_readme_values_table_matches_values_yaml():
    from tests.helm.values_table import rows

    readme = (CHART / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    assert table == rows(), "regenerate with: python -m tests.helm.values_table"
