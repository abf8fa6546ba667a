"""Every Serve config in ray_configs/ is valid for Ray Serve and builds the Prism application."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from common.config import PrismConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "ray_configs").glob("*.yaml"))


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
    assert names == {"Ingress", "Media", "Encode", "Prefill", "Decode"}
    assert cfg.deployments.decode.max_replicas >= cfg.deployments.decode.min_replicas


def _deployments(app):
    seen, stack = [], [app]
    while stack:
        node = stack.pop()
        seen.append(node._bound_deployment)
        stack.extend(a for a in node._bound_deployment.init_args if hasattr(a, "_bound_deployment"))
    return seen


def test_generated_grpc_stubs_match_the_proto(tmp_path):
    """The committed stubs are what ``make proto`` generates from the committed .proto."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
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
