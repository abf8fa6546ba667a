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
