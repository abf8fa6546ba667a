"""The ingress's plan → admit, without Serve: a decoded body becomes a frozen, priced, admitted request, and every
check refuses before anything downstream would run."""

from __future__ import annotations

import base64
import dataclasses
import subprocess
import sys

import pytest

from common.admission.quota import TenantQuotas
from common.admission.record import AdmissionRecorder
from common.config import ModelConfig, PrismConfig
from common.errors import InvalidRequestError, TenantQuotaExceeded
from common.model.loader import load_frontend
from services.ingress.plan import AdmittedRequest, RequestHeaders, admit, plan
from tests.mediakit import png_bytes
from tests.paths import ROOT


class _Sink:
    def __init__(self) -> None:
        self.counts: list[dict[str, str]] = []

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        self.counts.append(tags)

    def observe(self, name: str, value: float, **tags: str) -> None:
        raise AssertionError("the ingress observes no admission wait: nothing waits there")


@pytest.fixture(scope="module")
def setup(model_cache):
    cfg = PrismConfig.model_validate({"model": {"model": "prism-tiny-llava", "cache_dir": model_cache}})
    return cfg, load_frontend(ModelConfig(model="prism-tiny-llava", cache_dir=model_cache))


def _headers(**kw) -> RequestHeaders:
    return RequestHeaders.read(lambda name: kw.get(name.removeprefix("x-prism-")), "key", kw.get("deadline"))


def _image_body(text: str = "What is this?") -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 20}


def test_a_body_becomes_a_frozen_admitted_request(setup):
    cfg, frontend = setup
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    planned = plan(cfg, frontend, "alpha", body, _headers(priority="batch", deadline="5000"), now=1000.0)
    assert planned.tenant == "alpha" and planned.priority == "batch" and planned.deadline == 1005.0
    assert planned.refs == () and planned.sampling.max_tokens == 40
    assert planned.vector.text_tokens > 0 and planned.vector.max_output_tokens == 40
    assert planned.kv_blocks == planned.vector.kv_blocks  # text-only: the reservation is exact
    assert planned.route is not None and planned.route.media is None and planned.route.prefix
    sink = _Sink()
    quotas = TenantQuotas(cfg.admission)
    ticket = quotas.enter("alpha")
    admitted = admit(planned, ticket, cfg, quotas, AdmissionRecorder(sink, "ingress"))
    assert isinstance(admitted, AdmittedRequest) and admitted.ticket is ticket and ticket.admitted
    assert admitted.request is planned.request and admitted.vector == planned.vector
    with pytest.raises(dataclasses.FrozenInstanceError):
        admitted.priority = "interactive"  # type: ignore[misc]
    assert sink.counts == [
        {"stage": "ingress", "tenant": "alpha", "class": "batch", "result": "admitted", "reason": "immediate"}
    ]


def test_media_is_referenced_once_and_its_kv_estimated(setup):
    cfg, frontend = setup
    planned = plan(cfg, frontend, "t", _image_body(), _headers())
    assert len(planned.refs) == 1 and planned.refs[0].kind == "image"
    assert planned.route is not None and planned.route.media is not None
    tokens = planned.vector.text_tokens + frontend.small_image_tokens + 20
    assert planned.kv_blocks == -(-tokens // cfg.engine.kv_block_size)
    assert planned.priority == "interactive"


def test_n_choices_are_priced_as_one_prompt_and_n_outputs(setup):
    """``n``: the reservation is the engine's lease for the n sequences (the prompt's full blocks once); without
    ``max_tokens`` each choice gets its share of the request's output limit, so a default request is never refused."""
    cfg, frontend = setup
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "n": 4}
    planned = plan(cfg, frontend, "t", body, _headers())
    bs, prompt = cfg.engine.kv_block_size, planned.vector.text_tokens
    span, full = -(-(prompt + 40) // bs), prompt // bs
    assert planned.sampling.n == 4 and planned.vector.max_output_tokens == 160
    assert planned.kv_blocks == planned.vector.kv_blocks == span + 3 * (span - full)
    unset = {k: v for k, v in body.items() if k != "max_tokens"}
    assert plan(cfg, frontend, "t", unset, _headers()).sampling.max_tokens == 1024  # (4 × 1024 = the 4096 limit)
    eight = plan(cfg, frontend, "t", {**unset, "n": 8}, _headers())
    assert eight.sampling.max_tokens == 512 and eight.vector.max_output_tokens == 4096
    quotas = TenantQuotas(cfg.admission)
    assert admit(eight, quotas.enter("t"), cfg, quotas, AdmissionRecorder(_Sink(), "ingress")).sampling.n == 8


def test_the_body_priority_wins_and_an_invalid_header_is_a_400_only_without_one(setup):
    cfg, frontend = setup
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}]}
    bad = _headers(priority="urgent")
    assert bad.priority is None and bad.priority_invalid and bad.header_class == "interactive"
    assert plan(cfg, frontend, "t", {**body, "priority": "batch"}, bad).priority == "batch"
    with pytest.raises(InvalidRequestError) as info:
        plan(cfg, frontend, "t", body, bad)
    assert info.value.param == "X-Prism-Priority"


def test_limits_and_quota_refuse_and_are_counted(setup):
    cfg, frontend = setup
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 8}
    strict = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_prompt_tokens": 100})})
    sink = _Sink()
    recorder = AdmissionRecorder(sink, "ingress")
    quotas = TenantQuotas(strict.admission)
    with pytest.raises(InvalidRequestError) as info:
        admit(plan(strict, frontend, "t", body, _headers()), quotas.enter("t"), strict, quotas, recorder)
    assert info.value.code == "prompt_too_long"
    capped = PrismConfig.model_validate(
        {"model": cfg.model.model_dump(), "admission": {"tenants": {"t": {"max_media_in_flight": 1}}}}
    )
    quotas = TenantQuotas(capped.admission)
    short = {**body, "messages": [{"role": "user", "content": "hi"}]}
    media = _image_body()
    admit(plan(capped, frontend, "t", media, _headers()), quotas.enter("t"), capped, quotas, recorder)
    with pytest.raises(TenantQuotaExceeded):  # a second request with media, over its tenant's cap
        admit(plan(capped, frontend, "t", media, _headers()), quotas.enter("t"), capped, quotas, recorder)
    admit(plan(capped, frontend, "t", short, _headers()), quotas.enter("t"), capped, quotas, recorder)
    assert [(c["result"], c["reason"]) for c in sink.counts] == [
        ("refused", "limit"),
        ("admitted", "immediate"),
        ("refused", "quota"),
        ("admitted", "immediate"),
    ]


def test_planning_needs_no_ray():
    code = "import sys, services.ingress.plan\nprint(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
