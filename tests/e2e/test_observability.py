"""Traces, metrics and the request log after real traffic against the deployed app.

A traced response decomposes its time to first token into contiguous stage spans; the metrics endpoint exposes
every declared metric with values that follow the traffic (request counts, cache hits on a repeated image, KV blocks
back to 0); the request log names media by keyed hash and never holds the URL or the prompt.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import time
import uuid

import httpx

from common.media.synthetic import synthetic_image
from common.obs.catalogue import METRICS
from tests.e2e.conftest import API_KEY
from tests.e2e.prometheus import settled, total, wait_for
from tests.mediakit import MediaServer, Route

MODEL = "prism-tiny-llava"
TRACE = {"X-Prism-Trace": "1"}
TTFT_PATH = [
    "ingress",
    "media.queue",
    "media.fetch",
    "media.admission",
    "media.decode",
    "media.process",
    "encode.transfer",
    "encode.queue",
    "encode",
    "prefill.transfer",
    "prefill.prompt",
    "prefill.queue",
    "prefill",
    "decode.transfer",
    "decode.queue",
    "first_token",
]


def _png(seed: int, size=(120, 90)) -> bytes:
    buf = io.BytesIO()
    synthetic_image(*size, seed=seed).save(buf, "PNG")
    return buf.getvalue()


def _messages(text: str, urls=()):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _stream_with_trace(client, messages, max_tokens=8):
    """(client-measured TTFT seconds, prism_trace, usage) of one streamed request."""
    start = time.time()
    ttft = None
    trace = usage = None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=TRACE,
    )
    for chunk in stream:
        if ttft is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            ttft = time.time() - start
        if chunk.usage is not None:
            usage = chunk.usage
            trace = chunk.model_extra.get("prism_trace")
    return ttft, trace, usage


def test_a_text_request_shows_its_kv_reservation_before_prefill(client):
    """Text only: the ingress reserves decode KV before it issues prefill — ``decode.reserve`` sits between the
    ingress span and prefill's, contiguous with both, and the request decodes on the replica that holds it."""
    _, trace, _ = _stream_with_trace(client, _messages("Just text, please."))
    names = [s["name"] for s in trace["spans"]]
    text_path = ["ingress", "decode.reserve", *TTFT_PATH[TTFT_PATH.index("prefill.transfer") :]]
    assert names == [*text_path, "decode"], names
    for prev, nxt in itertools.pairwise(trace["spans"][: len(text_path)]):
        assert abs(prev["start_ms"] + prev["duration_ms"] - nxt["start_ms"]) < 0.01, (prev, nxt)
    s = _spans(trace)
    assert s["decode.reserve"]["attrs"]["blocks"] == math.ceil((trace["prompt_tokens"] + 8) / 16)
    route = trace["cache"]["routing"]["decode"]
    assert route["outcome"] in ("reserved", "waited") and route["replica"] == s["decode.transfer"]["attrs"]["replica"]


def _spans(trace) -> dict[str, dict]:
    return {s["name"]: s for s in trace["spans"]}


def test_traced_stream_decomposes_ttft_into_contiguous_stage_spans(client):
    with MediaServer() as server:
        server.routes["/t.png"] = Route(body=_png(101, (120, 90)), headers={"Content-Type": "image/png"})
        client_ttft, trace, usage = _stream_with_trace(client, _messages("Describe it.", [server.url("/t.png")]))
    assert trace is not None and trace["status"] == 200 and trace["code"] == "ok"
    names = [s["name"] for s in trace["spans"]]
    assert names == [*TTFT_PATH, "decode"]
    path = trace["spans"][: len(TTFT_PATH)]
    for prev, nxt in itertools.pairwise(path):  # each span starts where the previous one ended
        assert abs(prev["start_ms"] + prev["duration_ms"] - nxt["start_ms"]) < 0.01, (prev, nxt)
    assert path[0]["start_ms"] == 0
    span_sum = sum(s["duration_ms"] for s in path)
    assert abs(span_sum - trace["ttft_ms"]) <= 1.0 + 0.01 * trace["ttft_ms"], (span_sum, trace["ttft_ms"])
    # The server's TTFT lies inside the client's: the client also pays the proxy and its own HTTP.
    assert 0.25 * client_ttft * 1000 <= trace["ttft_ms"] <= client_ttft * 1000 + 1.0
    s = _spans(trace)
    assert s["media.process"]["attrs"]["pixels"] == 120 * 90
    assert s["media.process"]["attrs"]["visual_tokens"] == trace["visual_tokens"] == 144
    assert s["media.process"]["attrs"]["prompt_tokens"] == trace["prompt_tokens"]  # the media stage's count is exact
    assert s["media.admission"]["attrs"]["pixels"] == 120 * 90 and not s["media.admission"]["attrs"]["waited"]
    assert s["media.fetch"]["attrs"]["bytes"] > 0 and s["media.decode"]["attrs"]["frames"] == 1
    # the request's vector counts the fetched URL's bytes (the ingress can count only data URLs)
    assert s["media.process"]["attrs"]["media_bytes"] == s["media.fetch"]["attrs"]["bytes"] == len(_png(101, (120, 90)))
    assert s["prefill"]["attrs"]["prompt_tokens"] == trace["prompt_tokens"] == usage.prompt_tokens
    assert s["prefill"]["attrs"]["kv_blocks"] == math.ceil(usage.prompt_tokens / 16)
    assert s["decode.transfer"]["attrs"]["backend"] == "object_store"
    assert s["decode"]["attrs"]["output_tokens"] == usage.completion_tokens == trace["output_tokens"]
    assert trace["itl_ms"] is None or trace["itl_ms"]["max"] >= trace["itl_ms"]["p50"]


def test_untraced_response_has_no_trace_and_errors_carry_one(client, prism_server):
    r = client.chat.completions.create(model=MODEL, messages=_messages("Hi"), max_tokens=2, temperature=0)
    assert "prism_trace" not in (r.model_extra or {})

    base, _ = prism_server
    bad = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": _messages("Hi"), "max_tokens": 10**6},
        headers={"Authorization": f"Bearer {API_KEY}", **TRACE},
        timeout=30,
    )
    assert bad.status_code == 400
    body = bad.json()
    assert body["error"]["param"] == "max_tokens"
    assert body["prism_trace"]["status"] == 400 and body["prism_trace"]["code"] == body["error"]["code"]


def test_streamed_trace_without_a_usage_chunk_rides_on_the_last_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=_messages("Hi."), max_tokens=4, temperature=0, stream=True, extra_headers=TRACE
        )
    )
    assert all(c.choices for c in chunks), "no usage chunk unless asked"
    assert chunks[-1].choices[0].finish_reason and chunks[-1].model_extra["prism_trace"]["status"] == 200


def test_second_identical_image_hits_processor_and_encoder_caches(client, prism_server):
    _, config = prism_server
    url = config["_metrics_url"]
    label = {"application": "prism", "cache": "encoder", "result": "hit"}
    before = total(settled(url), "ray_prism_cache_lookups_total", **label)
    with MediaServer() as server:
        server.routes["/same.png"] = Route(body=_png(202), headers={"Content-Type": "image/png"})
        traces = [_stream_with_trace(client, _messages("What is it?", [server.url("/same.png")]))[1] for _ in range(2)]
    assert traces[0]["cache"]["processor"] == {"hits": 0, "misses": 1}
    assert traces[0]["cache"]["encoder"] == {"hits": 0, "misses": 1}
    assert traces[1]["cache"]["processor"] == {"hits": 1, "misses": 0}
    assert traces[1]["cache"]["encoder"] == {"hits": 1, "misses": 0}
    # the same media is named by the same keyed hash, which is not its plain digest
    hashes = [_spans(t)["media.process"]["attrs"]["media"] for t in traces]
    assert hashes[0] == hashes[1] and len(hashes[0][0]) == 16
    samples = wait_for(url, lambda s: total(s, "ray_prism_cache_lookups_total", **label) >= before + 1)
    assert total(samples, "ray_prism_cache_lookups_total", **label) == before + 1


def test_metrics_follow_the_traffic_and_every_declared_metric_is_exported(client, prism_server, decode_stats):
    base, config = prism_server
    url = config["_metrics_url"]
    ok = {"application": "prism", "code": "ok", "protocol": "http"}
    bad = {"application": "prism", "code": "invalid_request", "protocol": "http"}
    first = settled(url)
    before_ok = total(first, "ray_prism_requests_total", **ok)
    before_bad = total(first, "ray_prism_requests_total", **bad)
    with MediaServer() as server:
        server.routes["/m.png"] = Route(body=_png(303), headers={"Content-Type": "image/png"})
        for i in range(3):
            client.chat.completions.create(
                model=MODEL, messages=_messages(f"Say {i}", [server.url("/m.png")]), max_tokens=6, temperature=0,
                extra_body={"guided_regex": "[a-z]{1,4}"} if i == 2 else None,  # (the grammar metrics count it)
            )  # fmt: skip
    _stream_with_trace(client, _messages("Stream please"))
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": _messages("x"), "max_tokens": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"

    def counted(s):
        return (
            total(s, "ray_prism_requests_total", **ok) >= before_ok + 4
            and total(s, "ray_prism_requests_total", **bad) >= before_bad + 1
            and total(s, "ray_prism_grammar_masked_steps_total") >= 1
        )

    samples = wait_for(url, counted)
    assert total(samples, "ray_prism_requests_total", **ok) == before_ok + 4
    assert total(samples, "ray_prism_requests_total", **bad) == before_bad + 1
    names = {n for n, _, _ in samples}
    # (metrics of replica failures and departures are checked by the tests that cause one: test_two_replicas.py,
    # tests/defaults/test_operator_tools.py)
    missing = [m.name for m in METRICS if m.in_replica and not m.on_failure and not set(m.series_names) <= names]
    assert not missing, f"declared but not exported: {missing}"
    # plausible values: per-stage series exist for every stage, histograms counted the requests
    stages = {lab.get("stage") for n, lab, _ in samples if n == "ray_prism_stage_work_seconds_count"}
    assert {"media", "encode", "prefill", "decode"} <= stages
    assert total(samples, "ray_prism_ttft_seconds_count", application="prism") >= 4
    assert total(samples, "ray_prism_replicas", application="prism") == 5
    assert total(samples, "ray_prism_kv_blocks_free", application="prism") > 0
    assert decode_stats()["kv_blocks_used"] == 0
    samples = wait_for(url, lambda s: total(s, "ray_prism_kv_blocks_used", application="prism") == 0)
    assert total(samples, "ray_prism_kv_blocks_used", application="prism") == 0
    assert total(samples, "ray_prism_stage_in_flight", application="prism") == 0


def test_request_log_has_one_line_per_request_without_url_or_prompt(client, prism_server):
    _, config = prism_server
    secret_prompt = f"the secret word is {uuid.uuid4().hex}"
    with MediaServer() as server:
        path = f"/private-{uuid.uuid4().hex}.png"
        server.routes[path] = Route(body=_png(404), headers={"Content-Type": "image/png"})
        r = client.chat.completions.create(
            model=MODEL, messages=_messages(secret_prompt, [server.url(path)]), max_tokens=4, temperature=0
        )
    log_text = ""
    end = time.time() + 10
    while time.time() < end and r.id not in log_text:
        time.sleep(0.2)
        with open(config["_request_log"], encoding="utf-8") as f:
            log_text = f.read()
    lines = [json.loads(line) for line in log_text.splitlines() if r.id in line]
    assert len(lines) == 1
    line = lines[0]
    assert line["event"] == "prism.request" and line["status"] == 200 and line["tenant"] == "tenant-a"
    assert line["visual_tokens"] == 144 and line["output_tokens"] == r.usage.completion_tokens
    raw = json.dumps(line)
    assert path not in raw and "private-" not in raw and "127.0.0.1" not in raw
    assert secret_prompt not in raw and "secret" not in raw


def test_a_traceparent_continues_into_one_otlp_trace_with_a_span_per_stage(client, prism_server, otlp_receiver):
    """The client's W3C ``traceparent`` is continued: the app exports one OTLP trace (to a real receiver, decoded
    with ``opentelemetry-proto``) whose root ``prism.request`` is the client span's child and whose children are the
    request's stage spans — the same ones ``X-Prism-Trace`` returns, with their times — and the response's
    ``traceresponse`` names it; an untraced call starts a trace of its own, gRPC returns it as trailing metadata."""
    import base64

    import grpc

    from services.proto import prism_pb2, prism_pb2_grpc

    parent_trace, parent_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    url = "data:image/png;base64," + base64.b64encode(_png(77)).decode()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages("What is shown?", [url]), max_tokens=6,
        extra_headers={**TRACE, "traceparent": f"00-{parent_trace}-{parent_span}-01"},
    )  # fmt: skip
    names = [s["name"] for s in raw.parse().model_extra["prism_trace"]["spans"]]
    spans = otlp_receiver.trace(parent_trace, until=lambda s: len(s) == len(names) + 1)
    (root,) = [s for s in spans if s.name == "prism.request"]
    assert root.parent_span_id == parent_span and root.service == "prism"
    assert raw.headers["traceresponse"] == f"00-{parent_trace}-{root.span_id}-01"
    children = [s for s in spans if s is not root]
    assert sorted(s.name for s in children) == sorted(names)
    assert {"ingress", "media.process", "encode", "prefill", "decode.queue", "decode"} <= {s.name for s in children}
    assert all(s.parent_span_id == root.span_id and root.start_ns <= s.start_ns <= s.end_ns for s in children)
    assert root.attributes["prism.status"] == 200 and root.attributes["prism.output_tokens"] == 6

    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages("Hello"), max_tokens=2
    )  # (no traceparent: a new trace, still exported)
    own = plain.headers["traceresponse"].split("-")[1]
    assert own != parent_trace and otlp_receiver.trace(own, until=lambda s: len(s) >= 3)

    channel = grpc.insecure_channel(f"127.0.0.1:{prism_server[1]['_grpc_port']}")
    body = {"model": MODEL, "messages": _messages("Hi"), "max_tokens": 2}
    request = prism_pb2.GenerateRequest(chat_completion_json=json.dumps(body), api_key=API_KEY)
    metadata = (("application", "prism"), ("traceparent", f"00-{uuid.uuid4().hex}-{parent_span}-01"))
    _, call = prism_pb2_grpc.PrismStub(channel).Generate.with_call(request, metadata=metadata, timeout=60)
    returned = dict(call.trailing_metadata())["traceresponse"]
    assert returned.split("-")[1] == metadata[1][1].split("-")[1]
    channel.close()
