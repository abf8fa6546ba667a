"""``n`` choices against ``make serve`` (the split path) with the official ``openai`` client and gRPC: one prefill,
the prompt's full KV blocks held once for all choices, and each choice exactly the same request alone with that
choice's seed (``seed + i``); streamed equals not; over ``server.max_n`` is refused by name."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from services.proto import prism_pb2, prism_pb2_grpc
from tests.served import API_KEY

MODELS = ("prism-tiny-llava", "prism-tiny-qwen2vl")
ASK = {"messages": [{"role": "user", "content": "Tell me a story about a small boat on the sea."}], "max_tokens": 12}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


@pytest.mark.parametrize("model", MODELS)
def test_each_choice_is_the_request_alone_with_its_seed(client, served, model):
    sampled = dict(model=model, temperature=1.0, top_p=0.95, logprobs=True, top_logprobs=2, **ASK)
    many = client.chat.completions.create(
        **sampled, n=4, seed=7, extra_body={"return_token_ids": True}, extra_headers={"X-Prism-Trace": "1"}
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    alone = [
        client.chat.completions.create(**sampled, seed=7 + i, extra_body={"return_token_ids": True}).choices[0]
        for i in range(4)
    ]
    assert [_ids(c) for c in many.choices] == [_ids(c) for c in alone]
    assert [c.message.content for c in many.choices] == [c.message.content for c in alone]
    assert [c.finish_reason for c in many.choices] == [c.finish_reason for c in alone]
    for got, one in zip(many.choices, alone, strict=True):  # (prefill's first token's values, and decode's)
        assert [e.token for e in got.logprobs.content] == [e.token for e in one.logprobs.content]
        pairs = zip(got.logprobs.content, one.logprobs.content, strict=True)
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in pairs)
    assert len({tuple(_ids(c)) for c in many.choices}) > 1, "the seeds must make the choices differ"
    assert many.usage.completion_tokens == sum(len(_ids(c)) for c in many.choices)

    trace = many.model_extra["prism_trace"]
    names = [span["name"] for span in trace["spans"]]
    assert names.count("prefill") == 1, names  # (one prefill's work for the four choices)
    (queued,) = [span for span in trace["spans"] if span["name"] == "decode.queue"]
    prompt = len(many.model_extra["prompt_token_ids"])
    block = served["config"].get("engine", {}).get("kv_block_size", 16)
    full, span = prompt // block, -(-(prompt + ASK["max_tokens"]) // block)
    attrs = queued["attrs"]
    assert (attrs["choices"], attrs["kv_blocks_shared"]) == (4, full), "the prompt's full blocks, shared by all four"
    assert attrs["kv_blocks_held"] == span + 3 * (span - full) < 4 * span, "held once, not once per choice"


def test_streamed_choices_carry_their_index_and_equal_the_whole_answer(client):
    args = dict(model=MODELS[0], temperature=1.0, n=3, seed=21, **ASK)
    whole = client.chat.completions.create(**args)
    text, finish, usage = ["", "", ""], [None, None, None], None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert text == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_choices_over_grpc_match_http(client, served):
    body = dict(model=MODELS[1], temperature=1.0, n=2, seed=5, **ASK)
    http = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    channel = grpc.insecure_channel(f"127.0.0.1:{served['grpc']}")
    stub = prism_pb2_grpc.PrismStub(channel)
    request = prism_pb2.GenerateRequest(chat_completion_json=json.dumps(body))
    route = (("application", "prism"), ("authorization", f"Bearer {API_KEY}"))
    unary = stub.Generate(request, metadata=route, timeout=60)
    assert [list(c.token_ids) for c in unary.choices] == [_ids(c) for c in http.choices]
    assert [c.text for c in unary.choices] == [c.message.content for c in http.choices]
    assert list(unary.token_ids) == _ids(http.choices[0])
    assert unary.usage.completion_tokens == http.usage.completion_tokens
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stub.GenerateStream(request, metadata=route, timeout=60):
        streamed[chunk.index].append(chunk.token_id)
    assert [streamed[0], streamed[1]] == [_ids(c) for c in http.choices]
    channel.close()


def test_more_choices_than_the_server_allows_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODELS[0], n=9, **ASK)
    error = refused.value.body
    assert (error["code"], error["param"]) == ("too_many_choices", "n") and "limit is 8" in error["message"]
