"""``logprobs`` / ``top_logprobs`` against ``make serve`` (both tiny models, the split path: prefill's first token
crosses the hand-off) through the official ``openai`` client: each value equals ``log_softmax`` of transformers' logits
at that position (the same model directory, teacher-forced over the served prompt and answer) within 1e-4, the
alternatives are the true top k, each token's ``bytes`` spell the answer; streamed equals not."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.served import API_KEY

MODELS = {"prism-tiny-llava": "reference_llava", "prism-tiny-qwen2vl": "reference_qwen"}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_logprobs_are_the_models_own_first_token_included(client, model, request):
    args = dict(model=model, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=16,
                temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    completion = client.chat.completions.create(**args, extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    prompt_ids, out_ids = completion.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(out_ids) == completion.usage.completion_tokens

    ref = request.getfixturevalue(MODELS[model])
    with torch.inference_mode():
        logits = ref.model(input_ids=torch.tensor([prompt_ids + out_ids[:-1]])).logits[0, len(prompt_ids) - 1 :]
    rows = torch.log_softmax(logits.float(), dim=-1)
    for entry, token, row in zip(content, out_ids, rows, strict=True):
        assert abs(entry.logprob - float(row[token])) < 1e-4
        best = torch.topk(row, 3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [ref.token_bytes(i) for i in best.indices.tolist()]
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(entry.top_logprobs, best.values, strict=True))
        assert entry.token == ref.token_bytes.text(token) and bytes(entry.bytes) == ref.token_bytes(token)
    special = {i for i, t in ref.tokenizer.added_tokens_decoder.items() if t.special}  # (the text skips them)
    visible = [e for e, t in zip(content, out_ids, strict=True) if t not in special]
    # (random weights write invalid UTF-8 too: the text shows U+FFFD where the bytes do not decode)
    assert b"".join(bytes(e.bytes) for e in visible).decode("utf-8", errors="replace") == choice.message.content

    streamed = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs and c.logprobs.content else []
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [(e.token, e.logprob, e.bytes) for e in content]


def test_logprobs_limits_are_refused_by_name(client):
    for extra, param in (
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="prism-tiny-llava", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4, **extra)  # fmt: skip
        assert info.value.body["param"] == param
