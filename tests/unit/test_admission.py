"""Admission is driven by the request's resource vector, not by prompt length alone."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.errors import InvalidRequestError, MediaTooLarge, Overloaded
from common.media.synthetic import synthetic_image
from common.sched.resources import Admission, AdmissionConfig, ResourceVector
from common.stages.process import process_images
from common.stages.prompt import build_prompt


def _vector(lm, n_images: int, size=(448, 448), text="hi", max_tokens=16) -> ResourceVector:
    media = process_images(lm, [synthetic_image(*size, seed=i) for i in range(n_images)])
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 100_000)
    return ResourceVector.of(prompt, media, max_tokens, 16)


def test_vector_measures_media_not_just_text(tiny_qwen):
    small, big = _vector(tiny_qwen, 1, (56, 56)), _vector(tiny_qwen, 3, (448, 448))
    assert small.text_tokens == big.text_tokens - 2 * 2  # vision start/end markers of the two extra images
    assert big.patches > 10 * small.patches and big.visual_tokens > 10 * small.visual_tokens
    assert big.pixels == 3 * 448 * 448
    assert big.kv_blocks == -(-(big.prompt_tokens + 16) // 16)


def test_short_prompt_with_heavy_media_is_refused_by_the_right_limit(tiny_qwen):
    rv = _vector(tiny_qwen, 3)
    adm = Admission(AdmissionConfig(max_request_visual_tokens=100))
    with pytest.raises(InvalidRequestError) as info:
        adm.admit(rv)
    assert info.value.code == "too_many_visual_tokens" and "limit is 100" in info.value.message
    adm = Admission(AdmissionConfig(max_request_patches=500, encoder_patch_budget=1000))
    with pytest.raises(MediaTooLarge) as info:
        adm.admit(rv)
    assert info.value.http_status == 413 and info.value.code == "too_many_patches"
    assert adm.in_flight() == {"patches": 0, "prompt_tokens": 0, "kv_blocks": 0}


def test_budgets_give_429_and_release_restores(tiny_qwen):
    rv = _vector(tiny_qwen, 1)
    cfg = AdmissionConfig(
        max_request_patches=rv.patches,
        encoder_patch_budget=2 * rv.patches,
        decode_kv_block_budget=10_000,
        retry_after_s=2.5,
    )
    adm = Admission(cfg)
    adm.admit(rv)
    adm.admit(rv)
    with pytest.raises(Overloaded) as info:
        adm.admit(rv)
    assert info.value.http_status == 429 and info.value.retry_after_s == 2.5 and "encoder" in info.value.message
    adm.release(rv)
    adm.admit(rv)
    adm.release(rv)
    adm.release(rv)
    assert adm.in_flight() == {"patches": 0, "prompt_tokens": 0, "kv_blocks": 0}
    with pytest.raises(RuntimeError):
        adm.release(rv)


def test_limits_must_fit_budgets():
    with pytest.raises(ValidationError):
        AdmissionConfig(max_request_patches=10, encoder_patch_budget=5)
