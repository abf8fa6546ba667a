"""The KubeRay chart, rendered by real Helm (the Go SDK through ``helm_python``) and validated as a cluster would.

For the default values and the GPU multi-node example: Helm lint passes; every built-in manifest validates against
the Kubernetes schemas (``kubernetes-validate``); the RayService validates against KubeRay's CRD OpenAPI schema
(vendored in ``tests/helm/kuberay``); its ``serveConfigV2`` validates against Ray Serve's own ``ServeDeploySchema``,
builds the Prism application, and — for the GPU example — is the Serve config of ``ray_configs/multi_node.yaml``.
Bad values are refused by ``values.schema.json`` (both by Helm and by jsonschema). What the chart secures by default
is tested in ``test_chart_security.py``.
"""

from __future__ import annotations

import copy
import json

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.config import PrismConfig
from common.obs.dashboards import render as render_dashboards
from tests.helm.chart import (
    CHART,
    GPU_VALUES,
    K8S_VERSION,
    ROOT,
    STAGE_GROUPS,
    crd_schema,
    one,
    render,
    serve_config,
    validate_openapi,
)


def test_helm_lint_passes(rendered):
    _, values, _ = rendered
    result = helm_python.lint(str(CHART), values, strict=True)
    assert result["total_charts_linted"] == 1 and result["errors"] == [], result
    assert [m for m in result["messages"] if m["severity"] >= 2] == [], result  # 2 warning, 3 error; 1 is info
    refused = helm_python.lint(str(CHART), {**(values or {}), "transport": "pigeon"}, strict=True)
    assert any("/transport" in e for e in refused["errors"]), refused  # the lint really checks values


def test_builtin_manifests_validate_against_kubernetes_schemas(rendered):
    _, _, docs = rendered
    builtin = [d for d in docs if d["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1", "policy/v1")]
    assert {d["kind"] for d in builtin} >= {"ConfigMap", "NetworkPolicy", "PodDisruptionBudget"}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_rayservice_validates_against_the_kuberay_crd(rendered):
    _, _, docs = rendered
    service = one(docs, "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    validate_openapi(service, crd_schema("ray.io_rayservices.yaml"))
    # the embedded cluster is also a valid RayCluster spec
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"}}
    cluster["spec"] = service["spec"]["rayClusterConfig"]
    validate_openapi(cluster, crd_schema("ray.io_rayclusters.yaml"))
    # every pod template is a valid Kubernetes PodTemplateSpec
    spec = service["spec"]["rayClusterConfig"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_crd_validation_catches_a_broken_spec():
    service = one(render(), "RayService")
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        validate_openapi(service, crd_schema("ray.io_rayservices.yaml"))


def test_one_worker_group_per_stage_pinned_by_custom_resources(rendered):
    name, _, docs = rendered
    spec = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert "nvidia.com/gpu" not in json.dumps(spec["headGroupSpec"])
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert list(groups) == STAGE_GROUPS
    deployments = PrismConfig.model_validate(serve_config(docs)["applications"][0]["args"]["config"]).deployments
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
    from tests.unit.services.test_ray_configs import _deployments

    _, _, docs = rendered
    schema = ServeDeploySchema.model_validate(serve_config(docs))
    (app,) = schema.applications
    assert app.import_path == "services.app:build_app"
    built = build_app(app.args)
    assert {d.name for d in _deployments(built)} == {"Ingress", "Media", "Encode", "Prefill", "Decode"}


def test_chart_and_ray_configs_describe_the_same_deployments(rendered):
    name, _, docs = rendered
    ours = serve_config(docs)
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
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize(
    "prism",
    [
        {},
        {"server": {"max_body_bytes": 5_000_000}},
        {"media": {"max_request_bytes": 1000, "max_items_per_request": 2}, "server": {"max_text_chars": 77}},
        {
            "server": {
                "body_read_grace_s": 3.5,
                "body_min_bytes_per_s": 1000,
                "proxy_chunked_bytes_in_flight": 5_000_000,
                "max_concurrent_grpc_calls": 7,
                "retry_after_s": 4,
                "api_keys_reload_s": 2,
            }
        },
    ],
    ids=["defaults", "explicit", "derived", "guard"],
)
def test_every_ray_container_guards_the_front_door_as_the_config_does(prism):
    from services.platform.proxy_guard import ENV_GUARD, GuardSettings, ray_env, serve_apps

    docs = render({"prism": prism})
    settings = GuardSettings.of(serve_apps(serve_config(docs)))
    want = ray_env(settings)
    for container in _containers(docs):  # every node runs a Serve proxy
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert {k: env.get(k) for k in want if k != ENV_GUARD} == {k: v for k, v in want.items() if k != ENV_GUARD}
        assert GuardSettings.model_validate_json(env[ENV_GUARD]) == settings


def test_a_models_entry_needs_exactly_one_source():
    for entry in ({}, {"name": "a", "path": "b"}, {"name": "a", "extra": 1}):
        with pytest.raises(Exception):  # noqa: B017 (Helm's schema error type is the SDK's own)
            render({"models": [entry]})


def test_several_models_each_get_their_stages_on_the_stage_groups():
    from services.app import build_app
    from tests.unit.services.test_ray_configs import _deployments

    values = {"models": [{"name": "prism-tiny-llava"}, {"path": "qwen2-vl-2b", "dtype": "bfloat16", "servedName": "q"}]}
    docs = render(values)
    app = serve_config(docs)["applications"][0]
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
    names = {d.name for d in _deployments(build_app(serve_config(render(single))["applications"][0]["args"]))}
    assert len(names) == 9 and "Decode-prism-tiny-qwen2vl" in names


@pytest.mark.parametrize(
    ("topology", "groups"),
    [
        ("E/PD", ["media", "encode", "prefill-decode"]),
        ("EP/D", ["media", "encode-prefill", "decode"]),
        ("EPD", ["media", "encode-prefill-decode"]),
        ("ME/P/D", ["media-encode", "prefill", "decode"]),
        ("ME/PD", ["media-encode", "prefill-decode"]),
        ("MEPD", ["media-encode-prefill-decode"]),
    ],
)
def test_a_grouped_topology_gets_one_worker_group_per_deployment(topology, groups):
    """A grouped deployment runs on one worker group of its own (its last stage's workers settings), pinned there by
    the group's resource; the Serve config carries the topology and builds one deployment per group."""
    from common.config.topology import deployment_names
    from services.app import build_app
    from tests.unit.services.test_ray_configs import _deployments

    # (every stage's default CPUs would not fit one pod of the decode group's 8: the chart refuses that, tested apart)
    fit = {"stages": {"media": {"serve": {"num_cpus": 2}}}} if topology == "MEPD" else {}
    docs = render({"topology": topology, **fit})
    spec = one(docs, "RayService")["spec"]["rayClusterConfig"]
    workers = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert list(workers) == groups
    app = serve_config(docs)["applications"][0]
    cfg = PrismConfig.model_validate(app["args"]["config"])
    assert cfg.deployments.topology == topology
    for group in groups:
        resource = "prism_" + group.replace("-", "_")
        assert f'\\"{resource}\\"' in workers[group]["rayStartParams"]["resources"]
        for stage in group.split("-"):
            assert getattr(cfg.deployments, stage).resources == {resource: 1}
        last = group.split("-")[-1]
        limits = workers[group]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits == _values()["stages"][last]["workers"]["resources"]["limits"]
    names = {d.name for d in _deployments(build_app(app["args"]))}
    assert names == {"Ingress", *deployment_names(topology)}
    holds_media = next(g for g in groups if "media" in g.split("-"))  # (the ingress runs there)
    assert cfg.deployments.ingress.resources == {"prism_" + holds_media.replace("-", "_"): 1}
    several = {"topology": topology, "models": [{"name": "prism-tiny-llava"}, {"name": "prism-tiny-qwen2vl"}], **fit}
    cfg = PrismConfig.model_validate(serve_config(render(several))["applications"][0]["args"]["config"])
    assert {m.deployments.topology for m in cfg.models} == {topology}


def test_in_ingress_serves_the_model_in_the_ingress_replicas_on_its_group():
    """``inIngress`` (with ``MEPD``): the config sets ``deployments.in_ingress``, the app has no deployment but the
    ingress, which runs on the one worker group with the group's CPUs added to its own; refused with another
    topology, and refused when the ingress and the group together would not fit a pod of that group."""
    from services.app import build_app
    from tests.unit.services.test_ray_configs import _deployments

    # (with the chart's default CPUs a pod of the group's 8 holds the group with media at 2, or at 1 with the ingress)
    fit = {"stages": {"media": {"serve": {"num_cpus": 1}}}}
    docs = render({"topology": "MEPD", "inIngress": True, **fit})
    workers = one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in workers] == ["media-encode-prefill-decode"]
    app = serve_config(docs)["applications"][0]
    cfg = PrismConfig.model_validate(app["args"]["config"])
    assert cfg.deployments.in_ingress and cfg.deployments.topology == "MEPD"
    (ingress,) = _deployments(build_app(app["args"]))
    assert ingress.name == "Ingress"
    # (the ingress's pin to the group and the group's own, added: a worker of the group offers 1000)
    assert ingress.ray_actor_options["resources"] == {"prism_media_encode_prefill_decode": 2}
    held = cfg.deployments.group_stage(("media", "encode", "prefill", "decode")).num_cpus
    assert ingress.ray_actor_options["num_cpus"] == pytest.approx(cfg.deployments.ingress.num_cpus + held)
    with pytest.raises(helm_python.HelmRenderError, match="needs topology MEPD"):
        render({"topology": "EPD", "inIngress": True})
    tight = {"stages": {"media": {"serve": {"num_cpus": 2}}}}
    render({"topology": "MEPD", **tight})  # (apart, the ingress and the group each fit a pod)
    with pytest.raises(helm_python.HelmRenderError, match="ingress-media-encode-prefill-decode deployment asks 9 CPUs"):
        render({"topology": "MEPD", "inIngress": True, **tight})
    # two models: each replica holds both groups (1 + 2 x 7 CPUs), as services.app asks
    two = {"models": [{"name": "prism-tiny-llava"}, {"name": "prism-tiny-qwen2vl"}]}
    with pytest.raises(helm_python.HelmRenderError, match="asks 15 CPUs"):
        render({"topology": "MEPD", "inIngress": True, **fit, **two})
    roomy = {"media": {"serve": {"num_cpus": 0.5}}, "encode": {"serve": {"num_cpus": 0.5}}}
    roomy |= {"prefill": {"serve": {"num_cpus": 0.5}}, "decode": {"serve": {"num_cpus": 1}}}
    app = serve_config(render({"topology": "MEPD", "inIngress": True, "stages": roomy, **two}))["applications"][0]
    (ingress,) = _deployments(build_app(app["args"]))
    assert ingress.ray_actor_options["num_cpus"] == pytest.approx(1 + 2 * 2.5)


def test_monitoring_and_auth_objects(rendered):
    name, _, docs = rendered
    dashboards = one(docs, "ConfigMap")
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
        pods = one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for group in pods:  # the monitor selects every Ray pod, and each exposes the metrics port
            labels = group["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items()
            ports = group["template"]["spec"]["containers"][0]["ports"]
            assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in ports


def test_each_worker_group_has_a_disruption_budget_and_drains_before_it_stops(rendered):
    """One PodDisruptionBudget per worker group selecting exactly that group's pods (none for the head); a worker's
    preStop drains its Ray node within the grace its termination period leaves; the head stops Ray at once and stays
    out of the Serve Service."""
    _, _, docs = rendered
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    pdbs = [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    budgets = {b["selector"]["matchLabels"]["prism.io/group"]: b for b in pdbs}
    groups = cluster["workerGroupSpecs"]
    assert sorted(budgets) == sorted(g["groupName"] for g in groups)
    for group in groups:
        pod = group["template"]
        selector = budgets[group["groupName"]]["selector"]["matchLabels"]
        assert (
            selector.items() <= pod["metadata"]["labels"].items() and budgets[group["groupName"]]["maxUnavailable"] == 1
        )
        others = [g for g in [*groups, {"template": cluster["headGroupSpec"]["template"]}] if g is not group]
        assert not any(selector.items() <= g["template"]["metadata"]["labels"].items() for g in others)
        assert pod["spec"]["terminationGracePeriodSeconds"] == 150
        stop = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert stop == ["python", "-m", "services.platform.drain", "--grace-s", "120"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "-c", "ray stop"]
    assert one(docs, "RayService")["spec"]["excludeHeadPodFromServeSvc"] is True
    assert "gcsFaultToleranceOptions" not in cluster  # (off by default)
    docs = render({"podDisruptionBudget": {"enabled": False}, "serveService": {"excludeHead": False}})
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert one(docs, "RayService")["spec"]["excludeHeadPodFromServeSvc"] is False


def test_gcs_fault_tolerance_renders_kuberays_options():
    values = {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis.prism:6379",
                                    "redisPasswordSecret": {"name": "redis-auth", "key": "password"}}}  # fmt: skip
    service = one(render(values), "RayService")
    validate_openapi(service, crd_schema("ray.io_rayservices.yaml"))
    assert service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.prism:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}},
    }
    values["gcsFaultTolerance"]["redisPasswordSecret"]["name"] = ""  # (a Redis without a password)
    options = one(render(values), "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "redis.prism:6379"}


def test_drain_is_the_module_the_prestop_runs():
    """The preStop's module is importable and documents its lifecycle (what the chart runs in every worker pod)."""
    from services.platform import drain

    assert callable(drain.main) and "ray drain-node" in (drain.__doc__ or "")


def test_a_disabled_worker_group_unpins_its_stage():
    docs = render({"stages": {"encode": {"workers": {"enabled": False}}}})
    groups = [g["groupName"] for g in one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert groups == ["media", "prefill", "decode"]
    config = PrismConfig.model_validate(serve_config(docs)["applications"][0]["args"]["config"])
    assert config.deployments.encode.resources == {} and config.deployments.prefill.resources == {"prism_prefill": 1}


def test_model_from_a_host_path():
    docs = render({"model": {"source": "hostPath", "hostPath": "/data/models", "path": "qwen2-vl-2b"}})
    config = serve_config(docs)["applications"][0]["args"]["config"]
    assert config["model"]["model"] == "/models/qwen2-vl-2b"
    spec = one(docs, "RayService")["spec"]["rayClusterConfig"]
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
    "GCS fault tolerance without a Redis": {"gcsFaultTolerance": {"enabled": True}},
    "a disruption budget of no pods": {"podDisruptionBudget": {"maxUnavailable": 0}},
    "a negative drain grace": {"drain": {"graceSeconds": -5}},
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
        render(BAD_VALUES[case])


def test_example_values_are_valid():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(_merge(_values(), GPU_VALUES))


def test_readme_values_table_matches_values_yaml():
    from tests.helm.values_table import rows

    readme = (CHART / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    assert table == rows(), "regenerate with: python -m tests.helm.values_table"
