"""Rendering the chart as the tests read it: real Helm through ``helm_python``, the manifests parsed, the RayService's
Serve config and KubeRay's vendored CRD schemas at hand."""

from __future__ import annotations

from pathlib import Path

import helm_python
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "prism"
CRDS = Path(__file__).resolve().parent / "kuberay"
GPU_VALUES = yaml.safe_load((CHART / "examples" / "gpu-multinode.yaml").read_text())
K8S_VERSION = "1.30.0"
STAGE_GROUPS = ["media", "encode", "prefill", "decode"]


def render(values: dict | None = None) -> list[dict]:
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


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def crd_schema(kind_file: str) -> dict:
    crd = yaml.safe_load((CRDS / kind_file).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def validate_openapi(instance: dict, schema: dict) -> None:
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


def serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])
