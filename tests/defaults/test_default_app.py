"""``make serve`` with the default config serves both tiny models behind one endpoint, routed by ``model``: images to
each, video to the Qwen2-VL one, a clear 404 naming both for anything else — through the official ``openai`` client;
in its default topology (``EPD``) the answers are the reference pipeline's, token for token.

``PRISM_DEFAULTS_REPORT=<file>`` writes start-up time and memory of the two-model app as JSON.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from common.config import PrismConfig
from tests.mediakit import png_bytes, synthetic_image, video_bytes
from tests.served import API_KEY, ray_processes
from tests.served_exact import CASES, check_answer, reference_models

LLAVA, QWEN = "prism-tiny-llava", "prism-tiny-qwen2vl"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _image() -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(160, 120, seed=3))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _video() -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(2.0, fps=4, size=(96, 64))).decode()
    return {"type": "video_url", "video_url": {"url": url, "fps": 2}}


def _ask(client, model: str, *parts: dict) -> openai.types.chat.ChatCompletion:
    content = [*parts, {"type": "text", "text": "What do you see?"}]
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
    )


def _rss_mb() -> dict[str, int]:
    """RSS of every Ray process of the app (Serve replicas, proxy, controller, GCS, raylet …), by process name."""
    out: dict[str, int] = {}
    for _, name, rss in ray_processes():
        out[name] = out.get(name, 0) + rss
    return out


def test_both_models_answer_and_startup_is_measured(served, client):
    start = time.monotonic()
    answers = {model: _ask(client, model, _image()) for model in (LLAVA, QWEN)}
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers.values())
    rss = _rss_mb()
    report = {
        "health_s": round(served["up_s"], 1),
        "both_answer_s": round(served["up_s"] + time.monotonic() - start, 1),
        "rss_mb_total": sum(rss.values()),
        "rss_mb": dict(sorted(rss.items())),
    }
    if os.environ.get("PRISM_DEFAULTS_REPORT"):
        Path(os.environ["PRISM_DEFAULTS_REPORT"]).write_text(json.dumps(report, indent=1))
    replicas = {n.removeprefix("ServeReplica:prism:") for n in rss if n.startswith("ServeReplica:prism:")}
    # one ingress, and per model its media stage and the one deployment of its default topology (EPD)
    assert replicas == {"Ingress"} | {f"{d}-{m}" for d in ("Media", "EncodePrefillDecode") for m in (LLAVA, QWEN)}
    assert report["rss_mb_total"] < 12_000


def test_models_lists_both_with_their_modalities(client):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert set(cards) == {LLAVA, QWEN}
    assert cards[LLAVA]["modalities"] == ["text", "image"]
    assert cards[QWEN]["modalities"] == ["text", "image", "video"]
    assert cards[LLAVA]["prism_contract"]["family"] == "llava"
    assert cards[QWEN]["prism_contract"]["family"] == "qwen2_vl"


def test_video_to_the_qwen2vl_model(client):
    answer = _ask(client, QWEN, _video())
    assert answer.model == QWEN and answer.usage.prompt_tokens > 20
    assert answer.choices[0].message.content is not None


def test_each_model_has_its_own_pipeline(client):
    """The same text to both gives each model's own tokenizer and answer."""
    llava = client.chat.completions.create(
        model=LLAVA, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    qwen = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert (llava.model, qwen.model) == (LLAVA, QWEN)
    assert llava.model_extra["prompt_token_ids"] != qwen.model_extra["prompt_token_ids"]


def test_video_to_the_image_only_model_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, LLAVA, _video())
    assert "does not accept video" in info.value.body["message"]


def test_unknown_model_is_a_404_naming_the_served_ones(served):
    r = httpx.post(
        f"{served['base']}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert LLAVA in error["message"] and QWEN in error["message"]


def test_make_serve_listens_on_loopback_only(served):
    """Ray's token authentication is off under ``make serve``; what makes that safe is that no Ray server, proxy or
    metrics endpoint it starts listens beyond loopback (the gRPC proxy included, which Serve binds to every interface
    unless told otherwise)."""
    import ipaddress

    from tests.netutil import tcp_listeners
    from tests.served import serving_pids

    listeners = tcp_listeners(serving_pids(served["pid"]))
    ports = {port for _, port, _ in listeners}
    gcs = served["ray_port"]
    http = int(served["base"].rsplit(":", 1)[1])
    dashboard = int(served["dashboard"].rsplit(":", 1)[1])
    # the check saw the servers it is about (GCS, the HTTP and gRPC proxies, the metrics export, the dashboard / job
    # API) and more of Ray's
    assert {gcs, http, served["grpc"], served["metrics"], dashboard} <= ports and len(ports) > 6, listeners
    exposed = [(ip, port, pid) for ip, port, pid in listeners if not ipaddress.ip_address(ip).is_loopback]
    assert exposed == [], exposed


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # (field 19 of stat)


def test_the_latency_path_runs_ahead_of_the_throughput_work_on_the_cores(served):
    """``make serve`` starts Ray's workers at niceness 0 (not Ray's 15), so the media stage's 19 is a real step
    below the proxy and the ingress (services/platform/priority.py: at 15 the other tenant's text TTFT p95 was 21×
    idle under an image flood, at 0 4.3×)."""
    from tests.served import ray_processes, serving_pids

    ours = set(serving_pids(served["pid"]))
    nice = {name: _nice(pid) for pid, name, _ in ray_processes() if pid in ours}
    ingress = [v for k, v in nice.items() if "Ingress" in k]
    media = [v for k, v in nice.items() if "Media" in k]
    assert nice["ProxyActor"] == 0 and ingress == [0], nice
    assert media and set(media) == {19}, nice  # (its main thread: renicing its process at start reached it)


@pytest.fixture(scope="module")
def models(model_cache):
    return reference_models(model_cache)


@pytest.mark.parametrize(("model", "kind"), CASES, ids=lambda x: str(x))
def test_the_default_topology_answers_the_reference_tokens(served, models, client, model, kind):
    """``make serve``'s default topology (``EPD`` for both models): the reference's tokens, every hop in process."""
    topology = {m.name: m.deployments.topology for m in PrismConfig.model_validate(served["config"]).models}[model]
    assert topology == "EPD"
    check_answer(client, models[model], model, kind, topology)
