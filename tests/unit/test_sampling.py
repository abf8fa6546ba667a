"""Sampling: greedy is argmax, seeded sampling is reproducible per step, top_p narrows, stops cut the text."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from common.stages.sampler import sample_token


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(), step=0) == 1


def test_seeded_sampling_is_a_function_of_seed_and_step():
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample_token(logits, p, step=s) for s in range(20)]
    assert draws == [sample_token(logits, p, step=s) for s in range(20)]
    assert len(set(draws)) > 10
    other = [sample_token(logits, SamplingParams(temperature=1.0, seed=43), step=s) for s in range(20)]
    assert draws != other


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.tensor([1.0, 5.0, 4.9, 0.0])
    p = SamplingParams(temperature=1.5, top_p=0.01, seed=1)
    assert {sample_token(logits, p, step=s) for s in range(50)} == {1}


def test_unresolved_seed_is_resolved_once():
    p = SamplingParams(temperature=1.0).resolved()
    assert p.seed is not None and p.resolved() is p


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0}, {"stop": ["a"] * 5}, {"stop": [""]}],
)
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


def test_seeded_request_is_reproducible_and_stop_strings_cut(tiny_llava):
    lm = tiny_llava
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    image = synthetic_image(200, 150, seed=9)
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=123, ignore_eos=True)
    a = run_request(lm, messages, [image], p)
    b = run_request(lm, messages, [image], p)
    assert a.output.token_ids == b.output.token_ids and a.output.finish_reason == "length"

    full = run_request(lm, messages, [image], SamplingParams(max_tokens=24, ignore_eos=True)).output
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert len(stop) == 3
    cut = run_request(lm, messages, [image], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])).output
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)
