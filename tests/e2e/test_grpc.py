"""The gRPC API (unary and server-streaming) gives the same tokens as HTTP and maps errors to gRPC status codes."""

from __future__ import annotations

import json

import grpc
import pytest

from services.proto import prism_pb2, prism_pb2_grpc
from tests.e2e.conftest import API_KEY

MODEL = "prism-tiny-llava"
ROUTE = (("application", "prism"),)


@pytest.fixture(scope="module")
def stub(prism_server):
    _, config = prism_server
    channel = grpc.insecure_channel(f"127.0.0.1:{config['_grpc_port']}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield prism_pb2_grpc.PrismStub(channel)
    channel.close()


def _request(content, key: str = API_KEY, max_tokens: int = 12, deadline_ms: int = 0) -> prism_pb2.GenerateRequest:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return prism_pb2.GenerateRequest(chat_completion_json=json.dumps(body), api_key=key, deadline_ms=deadline_ms)


def test_unary_and_streaming_match_http(stub, client):
    http = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    unary = stub.Generate(_request("Name three colours."), metadata=ROUTE, timeout=60)
    assert list(unary.token_ids) == http.choices[0].model_extra["token_ids"]
    assert list(unary.prompt_token_ids) == http.model_extra["prompt_token_ids"]
    assert unary.text == http.choices[0].message.content and unary.finish_reason == "length"
    assert unary.usage.completion_tokens == 12

    # a traced call returns the trace as trailing metadata
    traced, call = stub.Generate.with_call(
        _request("Name three colours."), metadata=(*ROUTE, ("x-prism-trace", "1")), timeout=60
    )
    assert list(traced.token_ids) == list(unary.token_ids)
    trace = json.loads(dict(call.trailing_metadata())["prism-trace"])
    assert trace["protocol"] == "grpc" and trace["status"] == 200 and trace["output_tokens"] == 12
    assert trace["spans"][0]["name"] == "ingress" and trace["spans"][-1]["name"] == "decode"

    chunks = list(stub.GenerateStream(_request("Name three colours."), metadata=ROUTE, timeout=60))
    assert [c.token_id for c in chunks] == list(unary.token_ids)
    assert "".join(c.delta for c in chunks) == unary.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12


def test_structured_outputs_over_grpc_match_http(stub, client):
    """The constraint travels in the JSON body: unary and streamed gRPC answers are HTTP's, and valid."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A digit?"}], "max_tokens": 40, "temperature": 0}
    http = client.chat.completions.create(**body, extra_body=extra)
    request = prism_pb2.GenerateRequest(chat_completion_json=json.dumps({**body, **extra}), api_key=API_KEY)
    unary = stub.Generate(request, metadata=ROUTE, timeout=60)
    assert unary.text == http.choices[0].message.content and unary.finish_reason == "stop"
    assert 0 <= json.loads(unary.text)["n"] <= 9
    chunks = list(stub.GenerateStream(request, metadata=ROUTE, timeout=60))
    assert "".join(c.delta for c in chunks) == unary.text and chunks[-1].finish_reason == "stop"
    bad = {**body, "guided_regex": "(["}
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(prism_pb2.GenerateRequest(chat_completion_json=json.dumps(bad), api_key=API_KEY),
                      metadata=ROUTE, timeout=60)  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tool_calls_over_grpc_match_http(stub, client):
    """The calls HTTP returns in ``message.tool_calls`` come in ``tool_calls_json`` (unary, and the stream's last
    chunk), the text without them, and ``finish_reason`` ``tool_calls``."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    params = {"type": "object", "properties": {"n": digit}, "required": ["n"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 60, "temperature": 0,
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}  # fmt: skip
    http = client.chat.completions.create(**body).choices[0]
    request = prism_pb2.GenerateRequest(chat_completion_json=json.dumps(body), api_key=API_KEY)
    unary = stub.Generate(request, metadata=ROUTE, timeout=60)
    calls = json.loads(unary.tool_calls_json)
    assert unary.finish_reason == http.finish_reason == "tool_calls" and unary.text == ""
    expected = [(c.function.name, c.function.arguments) for c in http.message.tool_calls]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    assert 0 <= json.loads(calls[0]["function"]["arguments"])["n"] <= 9
    chunks = list(stub.GenerateStream(request, metadata=ROUTE, timeout=60))
    assert "".join(c.delta for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"
    streamed = json.loads(chunks[-1].tool_calls_json)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == expected


def test_logprobs_over_grpc_match_http(stub, client):
    """``logprobs_json``: the unary answer's entries are HTTP's ``logprobs.content``; each streamed chunk carries its
    own token's entry."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    http = client.chat.completions.create(**body).choices[0].logprobs.content
    request = prism_pb2.GenerateRequest(chat_completion_json=json.dumps(body), api_key=API_KEY)
    unary = json.loads(stub.Generate(request, metadata=ROUTE, timeout=60).logprobs_json)
    # tokens exact; log-probabilities to 1e-4: a repeated prompt's prefill hits the prefix cache, and a step's batch
    # differs from one request to the next (fp32 sums in another order: ~1e-6 apart)
    assert [(e["token"], e["bytes"]) for e in unary] == [(e.token, e.bytes) for e in http]
    assert [e["logprob"] for e in unary] == pytest.approx([e.logprob for e in http], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 for e in unary)
    chunks = [json.loads(c.logprobs_json) for c in stub.GenerateStream(request, metadata=ROUTE, timeout=60)]
    assert all(len(entries) == 1 for entries in chunks) and len(chunks) == len(unary)
    assert [e["token"] for (e,) in chunks] == [e["token"] for e in unary]
    assert [e["logprob"] for (e,) in chunks] == pytest.approx([e["logprob"] for e in unary], abs=1e-4)


@pytest.mark.parametrize(
    "request_kwargs,code",
    [
        ({"key": "wrong"}, grpc.StatusCode.UNAUTHENTICATED),
        ({"max_tokens": 100_000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"deadline_ms": 1}, grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
def test_errors_map_to_status_codes(stub, request_kwargs, code):
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as info:
            call(_request("hi", **request_kwargs), metadata=ROUTE, timeout=60)
        assert info.value.code() == code
        assert "error" in json.loads(info.value.details())


def test_blocked_media_is_permission_denied(stub):
    content = [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(_request(content), metadata=ROUTE, timeout=60)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert json.loads(info.value.details())["error"]["code"] == "media_fetch_blocked"


def test_overload_is_resource_exhausted(stub):
    calls = [
        stub.Generate.future(_request("A long story.", max_tokens=256), metadata=ROUTE, timeout=120) for _ in range(16)
    ]
    codes = []
    for call in calls:
        try:
            call.result()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
