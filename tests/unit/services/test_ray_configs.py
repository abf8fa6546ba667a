"""Every Serve config in ray_configs/ is valid for Ray Serve and builds the Prism application."""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from common.config import PrismConfig
from common.config.topology import deployment_names, group_name, groups
from tests.paths import ROOT

CONFIGS = sorted((ROOT / "ray_configs").glob("*.yaml"))


def test_there_are_three_configs():
    assert {p.name for p in CONFIGS} >= {"local_cpu.yaml", "single_gpu.yaml", "multi_node.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid_and_builds(path):
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app,) = schema.applications
    assert app.import_path == "services.app:build_app"
    cfg = PrismConfig.model_validate(app.args["config"])  # extra="forbid": typos fail here

    from services.app import build_app

    built = build_app(app.args)
    names = {d.name for d in _deployments(built)}
    expected = {"Ingress"}
    for sub in cfg.served():
        suffix = f"-{sub.model.name}" if cfg.models else ""
        stages = [] if sub.deployments.in_ingress else deployment_names(sub.deployments.topology)
        expected |= {f"{s}{suffix}" for s in stages}
    assert names == expected
    for sub in cfg.served():
        assert sub.deployments.decode.max_replicas >= sub.deployments.decode.min_replicas


def test_a_model_in_the_ingress_has_no_deployment_and_the_ingress_asks_for_its_resources():
    """``deployments.in_ingress`` (``MEPD``): the model's group is built in each ingress replica — none of its own —
    and the ingress asks for the group's CPUs and resources on top of its own; another model keeps its deployments."""
    from services.app import build_app

    group = {"media": {"num_cpus": 0.05}, "encode": {"num_cpus": 0.1}, "prefill": {"num_cpus": 0.2}}
    group["decode"] = {"num_cpus": 0.3, "num_gpus": 0.5, "resources": {"prism_mepd": 1}}
    models = [
        {"model": "prism-tiny-llava", "deployments": {"topology": "MEPD", "in_ingress": True, **group}},
        {"model": "prism-tiny-qwen2vl", "deployments": {"topology": "EPD"}},
    ]
    config = {"models": models, "deployments": {"ingress": {"num_cpus": 0.1, "resources": {"prism_front": 1}}}}
    built = {d.name: d for d in _deployments(build_app({"config": config}))}
    assert set(built) == {"Ingress", "Media-prism-tiny-qwen2vl", "EncodePrefillDecode-prism-tiny-qwen2vl"}
    ingress = built["Ingress"]
    assert ingress.ray_actor_options["num_cpus"] == pytest.approx(0.1 + 0.65)
    assert ingress.ray_actor_options["num_gpus"] == pytest.approx(0.5)
    assert ingress.ray_actor_options["resources"] == {"prism_mepd": 1, "prism_front": 1}
    held, other = ingress.init_args[1]
    assert held == [] and len(other) == 2  # (the held model's group is built in the replica; the other is called)
    # both models held: each group's CPUs, GPUs and resources added (two models share the replica, not a device share)
    models[1]["deployments"] = {"topology": "MEPD", "in_ingress": True, **group}
    (ingress,) = _deployments(build_app({"config": config}))
    assert ingress.ray_actor_options["num_cpus"] == pytest.approx(0.1 + 2 * 0.65)
    assert ingress.ray_actor_options["num_gpus"] == pytest.approx(1.0)
    assert ingress.ray_actor_options["resources"] == {"prism_mepd": 2, "prism_front": 1}


@pytest.mark.parametrize("topology", ["E/P/D", "E/PD", "EP/D", "EPD", "ME/P/D", "ME/PD"])
def test_only_a_topology_of_one_group_runs_in_the_ingress(topology):
    with pytest.raises(ValueError, match="in_ingress needs topology MEPD"):
        PrismConfig.model_validate({"deployments": {"topology": topology, "in_ingress": True}})


def test_local_default_serves_both_families_and_fits_two_cores():
    raw = yaml.safe_load((CONFIGS[0].parent / "local_cpu.yaml").read_text())
    cfg = PrismConfig.model_validate(raw["applications"][0]["args"]["config"])
    assert [m.name for m in cfg.models] == ["prism-tiny-llava", "prism-tiny-qwen2vl"]
    from services.app import build_app

    deployments = _deployments(build_app(raw["applications"][0]["args"]))
    cpus = sum(d.ray_actor_options["num_cpus"] * _replicas(d)[0] for d in deployments)
    most = sum(d.ray_actor_options["num_cpus"] * _replicas(d)[1] for d in deployments)
    assert cpus < 2 and most < 2, "Serve never starts a replica whose CPU share does not fit"
    largest = max(d.ray_actor_options["num_cpus"] for d in deployments)
    assert most + largest <= 2, "a rolling update starts a replacement before the replica it replaces stops"


@pytest.mark.parametrize(
    ("topology", "names"),
    [
        ("E/P/D", {"Media", "Encode", "Prefill", "Decode"}),
        ("E/PD", {"Media", "Encode", "PrefillDecode"}),
        ("EP/D", {"Media", "EncodePrefill", "Decode"}),
        ("EPD", {"Media", "EncodePrefillDecode"}),
        ("ME/P/D", {"MediaEncode", "Prefill", "Decode"}),
        ("ME/PD", {"MediaEncode", "PrefillDecode"}),
        ("MEPD", {"MediaEncodePrefillDecode"}),
    ],
)
def test_each_topology_deploys_its_groups_sized_for_what_they_hold(topology, names):
    """One deployment per group; a group takes its last stage's replicas and queue bounds, every stage's CPUs, the
    most GPUs one of its stages asks, and the router of its first stage (decode alone: pinned to the reservation)."""
    from services.app import build_app

    stages = {
        "media": {"num_cpus": 0.05},
        "encode": {"num_cpus": 0.1, "num_gpus": 0.1},
        "prefill": {"num_cpus": 0.2, "num_gpus": 0.2, "max_ongoing_requests": 50},
        "decode": {"num_cpus": 0.3, "num_gpus": 0.3, "min_replicas": 1, "max_replicas": 3, "max_ongoing_requests": 40},
    }
    config = {"deployments": {"topology": topology, **stages}, "routing": {"affinity": True}}
    built = {d.name: d for d in _deployments(build_app({"config": config}))}
    assert set(built) == names | {"Ingress"}
    for group in groups(topology):
        d = built[group_name(group)]
        assert d.ray_actor_options["num_cpus"] == pytest.approx(sum(stages[s]["num_cpus"] for s in group))
        assert d.ray_actor_options["num_gpus"] == pytest.approx(max(stages[s].get("num_gpus", 0) for s in group))
        last = stages[group[-1]]
        media_slots = 128 if "media" in group else 0  # (media's own slots too: a download holds a call of the group)
        assert d.max_ongoing_requests == last.get("max_ongoing_requests", 128) + media_slots
        assert _replicas(d) == ((1, 3) if group[-1] == "decode" else (1, 1))
        router = d._deployment_config.request_router_config.request_router_class
        assert router.endswith("PinnedRouter" if group == ("decode",) else "AffinityRouter"), router
        if len(group) > 1:
            assert list(d.init_args)[1] == group
        if group[0] == "media":  # (routed by the media, for the encoder's cache it feeds)
            kwargs = d._deployment_config.request_router_config.request_router_kwargs
            assert kwargs["stage"] == "encode" and kwargs["key"] == "media"
    ingress = built["Ingress"]
    (pipeline,) = ingress.init_args[1]
    assert (pipeline[0] is None) == ("Media" not in names), (
        "the ingress calls a media deployment only where it is apart"
    )


@pytest.mark.parametrize("affinity", [True, False])
def test_replicas_roll_start_before_stop_and_decode_drains_before_it_is_stopped(affinity):
    """Every deployment starts a replacement before its old replica stops (``max_surge_percent``: 100 by default);
    a stopping ingress or decode replica is given the drain grace and time to move its streams; a group ending with
    decode reports its replicas even without affinity."""
    from common.config.server import DRAIN_MOVE_S
    from services.app import build_app

    for topology in ("E/P/D", "EPD"):
        config = {"deployments": {"topology": topology, "media": {"max_surge_percent": 0}},
                  "routing": {"affinity": affinity}, "server": {"drain_grace_s": 12}}  # fmt: skip
        built = {d.name: d for d in _deployments(build_app({"config": config}))}
        surge = {name: d._deployment_config.max_surge_percent for name, d in built.items()}
        assert surge == {name: 0 if name == "Media" else 100 for name in built}
        for name, d in built.items():
            grace = d._deployment_config.graceful_shutdown_timeout_s
            if name.endswith("Decode") or name == "Ingress":  # (the grace, then time to move; not longer: a node
                assert grace == 12 + DRAIN_MOVE_S  # being drained would stop it before its replacement ran)
            if name.endswith("Decode"):
                router = d._deployment_config.request_router_config.request_router_class
                assert router.endswith("PinnedRouter" if name == "Decode" or not affinity else "AffinityRouter")
            elif name != "Ingress":
                assert grace == 20.0, "Serve's default: their calls are short"


def _replicas(d) -> tuple[int, int]:
    auto = d._deployment_config.autoscaling_config
    if auto is None:
        return d.num_replicas, d.num_replicas
    return auto.min_replicas, auto.max_replicas


def _bound(value):
    """Bound deployments among an init argument (Serve finds them inside dicts and lists too)."""
    if hasattr(value, "_bound_deployment"):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _bound(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _bound(v)


def _deployments(app):
    seen, stack = [], [app]
    while stack:
        node = stack.pop()
        seen.append(node._bound_deployment)
        stack.extend(_bound(list(node._bound_deployment.init_args)))
    return seen


def test_generated_grpc_stubs_match_the_proto(tmp_path):
    """The committed stubs are what ``make proto`` generates from the committed .proto."""
    import shutil
    import subprocess
    import sys

    root = ROOT
    (tmp_path / "services" / "proto").mkdir(parents=True)
    shutil.copy(root / "services/proto/prism.proto", tmp_path / "services/proto/prism.proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "services/proto/prism.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("prism_pb2.py", "prism_pb2_grpc.py"):
        assert (tmp_path / "services/proto" / name).read_text() == (root / "services/proto" / name).read_text()
    schema = ServeDeploySchema.model_validate(yaml.safe_load((root / "ray_configs/local_cpu.yaml").read_text()))
    assert schema.grpc_options.grpc_servicer_functions == ["services.proto.prism_pb2_grpc.add_PrismServicer_to_server"]
