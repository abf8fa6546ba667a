"""Sampling: greedy is argmax, seeded sampling is reproducible per step, top_p narrows, stops cut the text."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from common.stages.sampler import apply_penalties, sample_token


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(), step=0) == 1


def test_penalties_follow_openai_arithmetic():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, p, {0: 3, 2: 1})
    assert out.tolist() == [5.0 - 1.5 - 0.25, 4.0, 3.0 - 0.5 - 0.25, 0.0]
    assert sample_token(logits, p, step=3, counts={0: 3}) == 1, "penalised enough, the runner-up wins"
    assert sample_token(logits, p, step=3, counts={}) == 0, "nothing generated yet: nothing to penalise"
    assert sample_token(logits, SamplingParams(), step=3, counts={0: 9}) == 0, "no penalty set: counts change nothing"


def test_presence_penalty_changes_a_repetitive_answer(tiny_llava):
    messages = [{"role": "user", "content": "Say something."}]
    plain = run_request(tiny_llava, messages, [], SamplingParams(max_tokens=24, ignore_eos=True)).output.token_ids
    assert len(set(plain)) < len(plain), "the greedy answer repeats tokens"
    p = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    penalised = run_request(tiny_llava, messages, [], p).output.token_ids
    assert penalised[0] == plain[0], "the first token has nothing to penalise"
    assert penalised != plain and len(set(penalised)) > len(set(plain))


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
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"stop": ["a"] * 5},
        {"stop": [""]},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.1},
    ],
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
