"""Admission by resource vector: the vector filled in as its parts become known, per-request limits judged as early
as they can be (the ingress for text, the media stage for media), stage budgets and tenant quotas."""

from __future__ import annotations

import pytest

from common.admission.limits import check_limits
from common.admission.quota import TenantQuotas
from common.config import AdmissionConfig, Rate, TenantQuota
from common.errors import InvalidRequestError, MediaTooLarge, TenantQuotaExceeded
from common.media.synthetic import synthetic_image
from common.protocol.vector import ResourceVector
from common.stages.process import process_images
from common.stages.prompt import build_prompt, render_chat


def _content(n_images: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def _vector(lm, n_images: int, size=(448, 448), text="hi", max_tokens=16) -> ResourceVector:
    media = process_images(lm, [synthetic_image(*size, seed=i) for i in range(n_images)])
    prompt = build_prompt(lm, _content(n_images, text), media, 100_000)
    return _of(prompt, media, max_tokens)


def _of(prompt, media, max_tokens: int) -> ResourceVector:
    """The whole vector of a built prompt (what the prefill stage sees): its text tokens as the ingress counts them,
    completed by the media as the media stage does."""
    visual = sum(s.prompt_token_length for s in prompt.spans)
    text = len(prompt.token_ids) - visual
    at_ingress = ResourceVector.at_ingress(text + len(media), len(media), max_tokens, 16)
    return at_ingress.with_media(media, 16, visual_tokens=visual)


def test_vector_measures_media_not_just_text(tiny_qwen):
    small, big = _vector(tiny_qwen, 1, (56, 56)), _vector(tiny_qwen, 3, (448, 448))
    assert small.text_tokens == big.text_tokens - 2 * 2  # vision start/end markers of the two extra images
    assert big.patches > 10 * small.patches and big.visual_tokens > 10 * small.visual_tokens
    assert big.pixels == 3 * 448 * 448 and big.frames == 3
    assert big.kv_blocks == -(-(big.prompt_tokens + 16) // 16)


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_ingress_vector_completed_by_the_media_stage_is_the_prompt_prefill_builds(family, tiny_llava, tiny_qwen):
    """The ingress counts the prompt with one placeholder per item; the media stage adds each item's visual tokens.
    That count is exact — the very prompt prefill builds — so refusing on it early refuses nothing admissible."""
    lm = tiny_llava if family == "llava" else tiny_qwen
    messages = _content(2, "describe both pictures in detail")
    rendered = len(lm.tokenizer(render_chat(lm, messages))["input_ids"])
    at_ingress = ResourceVector.at_ingress(rendered, 2, 32, 16)
    media = process_images(lm, [synthetic_image(200, 120, seed=1), synthetic_image(90, 300, seed=2)])
    completed = at_ingress.with_media(media, 16)
    assert completed.media_bytes == at_ingress.media_bytes == 0  # the ingress saw no data URL
    assert at_ingress.with_media(media, 16, media_bytes=5_000).media_bytes == 5_000  # what the media stage fetched
    prompt = build_prompt(lm, messages, media, 100_000)
    built = _of(prompt, media, 32)
    assert completed.prompt_tokens == built.prompt_tokens and completed.kv_blocks == built.kv_blocks
    assert at_ingress.prompt_tokens <= completed.prompt_tokens  # the ingress's figure is a lower bound
    text_only = ResourceVector.at_ingress(rendered, 0, 32, 16)
    assert text_only.prompt_tokens == rendered and text_only.kv_blocks == -(-(rendered + 32) // 16)


def test_a_request_of_n_choices_counts_the_prompts_full_blocks_once(tiny_qwen):
    """``n`` choices: the KV the decode engine's lease for them needs (the prompt's full blocks once, each choice's own
    blocks after them), ``n`` × ``max_tokens`` output; completed by the media stage the same way."""
    from common.kv.pool import KVPool

    one = ResourceVector.at_ingress(40, 0, 30, 16)
    four = ResourceVector.at_ingress(40, 0, 30, 16, choices=4)
    span, full = -(-(40 + 30) // 16), 40 // 16
    assert (one.kv_blocks, four.kv_blocks) == (span, span + 3 * (span - full))
    assert four.max_output_tokens == 120 and four.kv_blocks < 4 * one.kv_blocks
    pool = KVPool(64, 16, tiny_qwen.kv_shape, tiny_qwen.dtype)
    assert pool.blocks_for_choices(40, 30, 4) == four.kv_blocks  # (what the engine leases)
    media = process_images(tiny_qwen, [synthetic_image(200, 120, seed=1)])
    with_media = ResourceVector.at_ingress(41, 1, 30, 16, choices=4).with_media(media, 16, visual_tokens=24)
    assert with_media.kv_blocks == pool.blocks_for_choices(40 + 24, 30, 4)
    with pytest.raises(InvalidRequestError) as info:
        check_limits(four, AdmissionConfig(max_request_output_tokens=100), 100_000, 100_000)
    assert info.value.code == "too_many_max_output_tokens" and "n × max_tokens" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        check_limits(four, AdmissionConfig(), 100_000, four.kv_blocks - 1)
    assert info.value.code == "kv_lease_exceeded" and "4 choices × max_tokens 30" in info.value.message


def test_limits_name_what_is_over(tiny_qwen):
    rv = _vector(tiny_qwen, 3)
    with pytest.raises(InvalidRequestError) as info:
        check_limits(rv, AdmissionConfig(max_request_visual_tokens=100), 100_000, 100_000)
    assert info.value.code == "too_many_visual_tokens" and "limit is 100" in info.value.message
    with pytest.raises(MediaTooLarge) as info:
        check_limits(rv, AdmissionConfig(max_request_patches=500), 100_000, 100_000)
    assert info.value.http_status == 413 and info.value.code == "too_many_patches"
    with pytest.raises(InvalidRequestError) as info:
        check_limits(rv, AdmissionConfig(), rv.prompt_tokens - 1, 100_000)
    assert info.value.code == "prompt_too_long" and "for 3 media items" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        check_limits(rv, AdmissionConfig(), 100_000, rv.kv_blocks - 1)
    assert info.value.code == "kv_lease_exceeded" and info.value.param == "max_tokens"
    check_limits(rv, AdmissionConfig(), rv.prompt_tokens, rv.kv_blocks)  # at the limits: admitted


def _rv(text: int = 10, media: int = 0) -> ResourceVector:
    return ResourceVector.at_ingress(text + media, media, 8, 16)


def _take(q: TenantQuotas, tenant: str, rv: ResourceVector):
    """``enter`` then ``admit``, as the ingress does (a refused ``admit`` gives the place back: the request's
    lifecycle releases its ticket however it ends)."""
    ticket = q.enter(tenant)
    try:
        q.admit(ticket, rv)
    except TenantQuotaExceeded:
        q.release(ticket)
        raise
    return ticket


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_tenant_concurrency_quota_refuses_only_that_tenant():
    cfg = AdmissionConfig(
        default_tenant=TenantQuota(max_in_flight=50),
        tenants={"alpha": TenantQuota(max_in_flight=3, max_media_in_flight=1)},
    )
    q = TenantQuotas(cfg, retry_after_s=2)
    first = _take(q, "alpha", _rv(media=1))
    with pytest.raises(TenantQuotaExceeded) as info:
        _take(q, "alpha", _rv(media=1))  # a second request with media
    assert info.value.http_status == 429 and info.value.code == "tenant_quota_exceeded"
    assert info.value.retry_after_s == 2 and "alpha" in info.value.message
    text = [_take(q, "alpha", _rv()), _take(q, "alpha", _rv())]  # text still fits under max_in_flight
    with pytest.raises(TenantQuotaExceeded):
        _take(q, "alpha", _rv())
    others = [_take(q, "beta", _rv(media=1)) for _ in range(10)]  # another tenant is untouched
    q.release(first)
    q.release(first)  # idempotent
    _take(q, "alpha", _rv(media=1))
    for t in text + others:
        q.release(t)
    assert q.in_flight() == {"alpha": 1, "beta": 0}


def test_token_bucket_charges_late_costs_and_refills():
    clock = _Clock()
    cfg = AdmissionConfig(tenants={"alpha": TenantQuota(pixels=Rate(per_s=1_000_000, burst=2_000_000))})
    q = TenantQuotas(cfg, clock=clock)
    t = _take(q, "alpha", _rv(media=1))
    q.charge(t, pixels=5_000_000)  # the media stage measured a big image: the bucket goes into debt
    q.release(t)
    with pytest.raises(TenantQuotaExceeded) as info:
        _take(q, "alpha", _rv(media=1))
    assert info.value.retry_after_s == 3  # 3 M pixels of debt at 1 M/s
    _take(q, "alpha", _rv())  # text spends no pixels: not held back by the pixel debt
    clock.t += 3.01
    _take(q, "alpha", _rv(media=1))


def test_output_tokens_are_charged_when_the_request_ends_and_a_debt_holds_the_next_ones_back():
    clock = _Clock()
    cfg = AdmissionConfig(tenants={"alpha": TenantQuota(completion_tokens=Rate(per_s=100, burst=200))})
    q = TenantQuotas(cfg, clock=clock)
    t = _take(q, "alpha", _rv())
    q.release(t, completion_tokens=500)  # a long generation: 300 tokens of debt
    q.release(t, completion_tokens=500)  # (released once: charged once)
    with pytest.raises(TenantQuotaExceeded) as info:
        q.enter("alpha")  # refused before its body is read
    assert "completion_tokens" in info.value.message and info.value.retry_after_s == 3
    _take(q, "beta", _rv())  # another tenant is not held back
    clock.t += 3.01
    q.release(_take(q, "alpha", _rv()), completion_tokens=0)


def test_enter_refuses_before_the_body_what_admit_would_refuse_and_holds_the_place_while_it_is_read():
    """``enter`` (the tenant known, the body not read) refuses a tenant at its request cap, with its request bucket
    empty or its prompt-token bucket in debt; otherwise it takes the request's in-flight place at once (a body still
    being read counts against the cap) and spends nothing; caps on media it cannot judge (no body)."""
    clock = _Clock()
    cfg = AdmissionConfig(
        tenants={
            "alpha": TenantQuota(max_in_flight=2, max_media_in_flight=1),
            "beta": TenantQuota(requests=Rate(per_s=1, burst=2), prompt_tokens=Rate(per_s=100, burst=100)),
        }
    )
    q = TenantQuotas(cfg, retry_after_s=2, clock=clock)
    first = q.enter("alpha")
    q.admit(first, _rv(media=1))
    reading = q.enter("alpha")  # at its media cap, but a text request would still be admitted: not judged here
    assert q.in_flight() == {"alpha": 2}  # the second one's body is still being read: it holds its place already
    with pytest.raises(TenantQuotaExceeded) as info:
        q.enter("alpha")
    assert info.value.retry_after_s == 2 and "2 requests in flight" in info.value.message
    q.release(reading)  # its upload failed before admission: the place goes back all the same
    q.release(reading)  # idempotent
    q.release(q.enter("alpha"))
    q.release(first)
    assert q.in_flight() == {"alpha": 0}

    for _ in range(5):
        q.release(q.enter("beta"))  # spends nothing: the request bucket (burst 2) is still full
    ticket = _take(q, "beta", _rv())
    q.charge(ticket, prompt_tokens=300)  # visual tokens measured later: the prompt-token bucket goes into debt
    with pytest.raises(TenantQuotaExceeded) as info:
        q.enter("beta")
    assert "prompt_tokens rate" in info.value.message and info.value.retry_after_s == 3
    clock.t += 3.01
    _take(q, "beta", _rv())
    _take(q, "beta", _rv())  # the request bucket (refilled to its burst of 2) is spent
    with pytest.raises(TenantQuotaExceeded) as info:
        q.enter("beta")
    assert "requests rate" in info.value.message
    q.release(q.enter("gamma"))  # another tenant is untouched

    debt = TenantQuotas(AdmissionConfig(default_tenant=TenantQuota(pixels=Rate(per_s=1, burst=10))), clock=clock)
    debt.charge(_take(debt, "delta", _rv(media=1)), pixels=1000)
    text = debt.enter("delta")  # a pixel debt holds back only requests with media, which the headers cannot tell
    debt.admit(text, _rv())
    with pytest.raises(ValueError):
        debt.admit(text, _rv())  # admitted once


def test_quota_share_splits_caps_and_rates_per_ingress_replica():
    cfg = AdmissionConfig(default_tenant=TenantQuota(max_in_flight=4, requests=Rate(per_s=10, burst=4)))
    q = TenantQuotas(cfg, share=0.5, clock=_Clock())
    held = [_take(q, "t", _rv()), _take(q, "t", _rv())]
    with pytest.raises(TenantQuotaExceeded):
        _take(q, "t", _rv())  # 4 × 0.5
    for h in held:
        q.release(h)
    with pytest.raises(TenantQuotaExceeded) as info:
        _take(q, "t", _rv())  # the request bucket (burst 4 × 0.5) is spent
    assert "requests rate" in info.value.message
