"""``make serve`` with grouped topologies set in its config (LLaVA ``E/PD``, Qwen2-VL ``EPD``: :mod:`.conftest`):
one deployment per group, and the answers token for token those of the reference pipeline (which equals
transformers' ``generate()``), through the official ``openai`` client — text, image and video. The grouped hops show
in the trace as in-process transfers."""

from __future__ import annotations

import base64

import openai
import pytest

from common.config import ModelConfig
from common.config.topology import group_name, groups
from common.media.synthetic import synthetic_image, video_bytes
from common.model.loader import load_model
from common.protocol.handoff import MediaRef
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from tests.mediakit import png_bytes
from tests.reference import media_tokens
from tests.security.conftest import API_KEY, TOPOLOGY
from tests.served import serve_processes

LLAVA, QWEN = "prism-tiny-llava", "prism-tiny-qwen2vl"
IMAGE = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(120, 90, seed=5))).decode()
VIDEO = "data:video/mp4;base64," + base64.b64encode(video_bytes(1.0, fps=10)).decode()
TEXT = "What is there?"
SAMPLING = SamplingParams(max_tokens=10)


@pytest.fixture(scope="module")
def models(model_cache):
    return {name: load_model(ModelConfig(model=name, cache_dir=model_cache)) for name in (LLAVA, QWEN)}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _ask(client, model: str, part: dict | None = None):
    content = [*([part] if part else []), {"type": "text", "text": TEXT}]
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
        extra_headers={"x-prism-trace": "1"},
    )


def test_each_model_runs_one_deployment_per_group_of_its_topology(served):
    names = {n.removeprefix("ServeReplica:prism:") for n in serve_processes() if n.startswith("ServeReplica:")}
    expected = {"Ingress"}
    for model, topology in TOPOLOGY.items():
        expected |= {f"{name}-{model}" for name in ["Media", *(group_name(g) for g in groups(topology))]}
    assert names == expected


@pytest.mark.parametrize(
    ("model", "kind"), [(LLAVA, None), (LLAVA, "image"), (QWEN, "image"), (QWEN, "video")], ids=lambda x: str(x)
)
def test_grouped_topologies_answer_the_reference_tokens(models, client, model, kind):
    lm = models[model]
    if kind is None:
        messages = [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]
        expected = list(run_request(lm, messages, [], SAMPLING).output.token_ids)
        answer = _ask(client, model)
    else:
        url = IMAGE if kind == "image" else VIDEO
        expected = media_tokens(lm, MediaRef(kind, url), TEXT, SAMPLING)
        answer = _ask(client, model, {"type": f"{kind}_url", f"{kind}_url": {"url": url}})
    assert answer.choices[0].model_extra["token_ids"] == expected
    spans = {s["name"]: s["attrs"] for s in answer.model_extra["prism_trace"]["spans"]}
    assert spans["decode.transfer"]["backend"] == "in_process", "prefill and decode share the replica in both"
    if kind is not None:
        grouped_encode = TOPOLOGY[model] == "EPD"
        assert spans["prefill.transfer"]["backend"] == ("in_process" if grouped_encode else "object_store")
