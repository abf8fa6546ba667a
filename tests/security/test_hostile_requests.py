"""Hostile and unsupported requests against the deployed app (``make serve``): each is refused with its own 4xx and an
OpenAI error body in under 2 s; 300 MB bodies (with and without Content-Length) are refused in the proxy without any
process growing by 100 MB — without a key, for the key, before a byte of the body is read; no replica restarts;
nothing the client sent reaches a log; the service answers normally afterwards.

``PRISM_CORPUS_REPORT=<file>`` writes the measured table (case → status → code → seconds) as JSON.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest

from services.platform.haproxy_launch import HEADERS_S
from services.proto import prism_pb2, prism_pb2_grpc
from tests.e2e.prometheus import total, wait_for
from tests.rawhttp import error_code, read_reply, status_of
from tests.security.conftest import API_KEY
from tests.served import serve_processes, server_errors

MODEL = "prism-tiny-llava"
KEY = {"authorization": f"Bearer {API_KEY}"}
SECRET = "SECRET-CLIENT-VALUE-7f3a"
FAST_S = 2.0
GRPC_BULK_S = 8.0
"""A refused 120 MB gRPC message: its time is grpc's own loopback transfer of the message, which the server's
refusal does not shorten (measured 2.9–3.2 s on 2026-12-04 on one of these machines, at this commit and the one
before it; under 2 s on others) — still nothing of it reaches a replica."""
MB = 1 << 20


def _body(**extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    body.update(extra)
    return body


def _msg(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def _nested(depth: int) -> dict:
    node: object = SECRET
    for _ in range(depth):
        node = {"k": node}
    return _body(metadata=node)


def _words(n: int) -> str:
    return " ".join(f"w{i % 997}x{i % 13}" for i in range(n))


def _image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": SECRET, "schema": schema, "strict": True}}


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


UNSAT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}, "required": ["n"]}
BAD_CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}

# (case, headers, body (dict → JSON, bytes as is), status, code)
CASES: list[tuple[str, dict, object, int, str]] = [
    ("no API key", {}, _body(), 401, "invalid_api_key"),
    ("wrong API key", {"authorization": "Bearer nope"}, _body(), 401, "invalid_api_key"),
    ("Content-Type text/plain", {**KEY, "content-type": "text/plain"}, _body(), 415, "unsupported_media_type"),
    (
        "form-encoded body",
        {**KEY, "content-type": "application/x-www-form-urlencoded"},
        b"model=x",
        415,
        "unsupported_media_type",
    ),
    ("truncated JSON", KEY, b'{"model": "prism-tiny', 400, "invalid_json"),
    ("JSON array", KEY, [1, 2, 3], 400, "invalid_json"),
    ("JSON nested 5,000 deep", KEY, b"[" * 5000 + b"]" * 5000, 400, "json_too_deep"),
    ("JSON nested 100,000 deep", KEY, b"[" * 100_000 + b"]" * 100_000, 400, "json_too_deep"),
    ("object nested 40 deep", KEY, _nested(40), 400, "json_too_deep"),
    ("40 MB text message", KEY, _body(messages=_msg("a" * (40 * MB))), 400, "text_too_long"),
    (
        "lone surrogate in the text",
        KEY,
        b'{"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "invalid_json",
    ),
    (
        "lone surrogate in an image URL",
        KEY,
        b'{"model": "prism-tiny-llava", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
        b'{"url": "https://example.com/\\udfff.png"}}]}]}',
        400,
        "invalid_json",
    ),
    (
        "width bomb: 21 MB of [{},{},...] in an unknown field",
        KEY,
        b'{"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "hi"}], "x": ['
        + b"{}," * (7 * MB)
        + b"{}]}",
        400,
        "json_too_wide",
    ),
    ("65 unknown fields", KEY, _body(**{f"x{i}": i for i in range(65)}), 400, "too_many_fields"),
    ("prompt over max_prompt_tokens", KEY, _body(messages=_msg(_words(12_000))), 400, "prompt_too_long"),
    ("300 messages", KEY, _body(messages=_msg("x") * 300), 400, "too_many_messages"),
    (
        "100 content parts",
        KEY,
        _body(messages=_msg([{"type": "text", "text": "x"}] * 100)),
        400,
        "too_many_content_parts",
    ),
    ("stop: 5 strings", KEY, _body(stop=[SECRET, "b", "c", "d", "e"]), 400, "invalid_stop"),
    ("stop: empty string", KEY, _body(stop=""), 400, "invalid_stop"),
    ("stop: 300 characters", KEY, _body(stop=SECRET * 12), 400, "invalid_stop"),
    ("functions (deprecated)", KEY, _body(functions=[{"name": "f"}]), 400, "unsupported_parameter"),
    ("tool_choice without tools", KEY, _body(tool_choice="auto"), 400, "invalid_tools"),
    ("tools: a name with spaces", KEY, _body(tools=[_tool("a b")]), 400, "invalid_tools"),
    (
        "tools: unsatisfiable parameters",
        KEY,
        _body(tools=[_tool("f", UNSAT)], tool_choice="required"),
        400,
        "invalid_tools",
    ),
    ("tool_calls arguments not JSON", KEY, _body(messages=[BAD_CALL]), 400, "invalid_request"),
    (
        "json_schema unsatisfiable",
        KEY,
        _body(response_format=_schema({"type": "integer", "minimum": 5, "maximum": 1})),
        400,
        "invalid_response_format",
    ),
    (
        "json_schema keyword not served",
        KEY,
        _body(response_format=_schema({"not": {"const": SECRET}})),
        400,
        "invalid_response_format",
    ),
    (
        "json_schema 70 KB",
        KEY,
        _body(response_format=_schema({"type": "string", "description": "x" * 70_000})),
        400,
        "invalid_response_format",
    ),
    (
        "json_schema $ref to nowhere",
        KEY,
        _body(response_format=_schema({"$ref": f"#/$defs/{SECRET}"})),
        400,
        "invalid_response_format",
    ),
    ("guided_regex invalid", KEY, _body(guided_regex="([" + SECRET), 400, "invalid_response_format"),
    (
        "two output constraints",
        KEY,
        _body(response_format={"type": "json_object"}, guided_regex="a+"),
        400,
        "invalid_response_format",
    ),
    ("response_format type xml", KEY, _body(response_format={"type": "xml"}), 400, "invalid_response_format"),
    ("top_logprobs 21", KEY, _body(logprobs=True, top_logprobs=21), 400, "invalid_request"),
    ("top_logprobs without logprobs", KEY, _body(top_logprobs=5), 400, "invalid_request"),
    ("logit_bias", KEY, _body(logit_bias={"42": 100}), 400, "unsupported_parameter"),
    ("n 9 (over server.max_n)", KEY, _body(n=9), 400, "too_many_choices"),
    ("best_of 2", KEY, _body(best_of=2), 400, "unsupported_parameter"),
    ("audio output", KEY, _body(modalities=["text", "audio"], audio={"voice": "x"}), 400, "unsupported_parameter"),
    ("frequency_penalty 3", KEY, _body(frequency_penalty=3), 400, "invalid_request"),
    ("temperature -1", KEY, _body(temperature=-1), 400, "invalid_request"),
    ("max_tokens 1,000,000", KEY, _body(max_tokens=1_000_000), 400, "invalid_request"),
    ("role function (deprecated)", KEY, _body(messages=[{"role": "function", "content": "x"}]), 400, "invalid_request"),
    (
        "tool message with an image",
        KEY,
        _body(messages=[{"role": "tool", "content": [_image_url(SECRET)]}]),
        400,
        "invalid_request",
    ),
    ("no messages", KEY, {"model": MODEL}, 400, "invalid_request"),
    ("content part type audio", KEY, _body(messages=_msg([{"type": "input_audio"}])), 400, "invalid_request"),
    ("unknown model", KEY, _body(model="gpt-" + SECRET), 404, "model_not_found"),
    (
        "9 images",
        KEY,
        _body(messages=_msg([_image_url("https://example.com/a.png")] * 9)),
        400,
        "too_many_media_items",
    ),
    (
        "data URL over the item limit",
        KEY,
        _body(messages=_msg([_image_url("data:image/png;base64," + "A" * (28 * MB))])),
        413,
        "media_too_large",
    ),
    ("file:// URL", KEY, _body(messages=_msg([_image_url("file:///etc/passwd")])), 403, "media_fetch_blocked"),
    (
        "cloud metadata URL",
        KEY,
        _body(messages=_msg([_image_url("http://169.254.169.254/latest/meta-data/")])),
        403,
        "media_fetch_blocked",
    ),
    (
        "SVG data URL",
        KEY,
        _body(messages=_msg([_image_url("data:image/svg+xml;base64,PHN2Zz4=")])),
        400,
        "invalid_media",
    ),
]
HEADER_CASES = [
    ("X-Prism-Deadline-Ms garbage", {"x-prism-deadline-ms": "soon"}, 400, "invalid_request"),
    ("X-Prism-Deadline-Ms over the maximum", {"x-prism-deadline-ms": "99999999"}, 400, "invalid_request"),
]


def _send(base: str, headers: dict, body: object) -> tuple[httpx.Response, float]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    start = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", content=content, headers=headers, timeout=30)
    return response, time.perf_counter() - start


def _upload(base: str, total: int, chunked: bool, key: bool = True) -> tuple[int, bytes, float, int]:
    """Stream ``total`` bytes of body over a raw socket until the server answers; (status, reply, seconds, bytes
    sent)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {API_KEY}\r\n" if key else ""
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
    start = time.perf_counter()
    sock.sendall((head + "\r\n").encode())
    piece = b"x" * MB
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
    sent, left = 0, memoryview(b"")
    # Never blocked in a send: the server may answer and then stop reading (HAProxy has, once in many runs, left such
    # a connection open and unread), and a blocking send of the next piece would then wait on it for ever. So send
    # only what the socket takes now, and stop as soon as an answer (or the close) is there to read.
    sock.setblocking(False)
    try:
        while sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable or not writable:  # answered or closed; or stalled for 10 s (then no reply will be read)
                break
            left = left or memoryview(frame)
            left = left[sock.send(left) :]
            sent += 0 if left else len(piece)
    except OSError:  # the server answered and closed while we were still sending
        pass
    sock.setblocking(True)
    reply = read_reply(sock, 10)
    return status_of(reply), reply, time.perf_counter() - start, sent


@pytest.fixture(scope="module")
def report():
    rows: list[dict] = []
    yield rows
    path = os.environ.get("PRISM_CORPUS_REPORT")
    if path:
        Path(path).write_text(json.dumps(rows, indent=1))


@pytest.fixture(scope="module")
def before(served):
    """Processes before any hostile request (after a first ordinary one warmed every stage)."""
    response, _ = _send(served["base"], KEY, _body())
    assert response.status_code == 200
    return serve_processes()


def _check_refusal(response: httpx.Response, seconds: float, status: int, code: str) -> None:
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert SECRET not in error["message"] or code == "model_not_found"  # the model name is echoed on purpose
    assert seconds < FAST_S, f"refused after {seconds:.2f}s"


@pytest.mark.parametrize(("case", "headers", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_corpus_case_is_refused_fast(served, before, report, case, headers, body, status, code):
    response, seconds = _send(served["base"], headers, body)
    report.append({"case": case, "status": response.status_code, "code": response.json()["error"]["code"],
                   "seconds": round(seconds, 3)})  # fmt: skip
    _check_refusal(response, seconds, status, code)


@pytest.mark.parametrize(("case", "headers", "status", "code"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_bad_headers_are_refused_fast(served, before, report, case, headers, status, code):
    response, seconds = _send(served["base"], {**KEY, **headers}, _body())
    report.append({"case": case, "status": response.status_code, "code": response.json()["error"]["code"],
                   "seconds": round(seconds, 3)})  # fmt: skip
    _check_refusal(response, seconds, status, code)


@pytest.mark.parametrize(
    ("case", "total", "chunked", "key", "status", "code"),
    [
        ("150 MB body without an API key (Content-Length)", 150 * MB, False, False, 401, "invalid_api_key"),
        ("150 MB body without an API key (chunked)", 150 * MB, True, False, 401, "invalid_api_key"),
        ("300 MB body (Content-Length)", 300 * MB, False, True, 413, "request_too_large"),
        ("300 MB body (chunked, no Content-Length)", 300 * MB, True, True, 413, "request_too_large"),
        ("300 MB body (chunked) again", 300 * MB, True, True, 413, "request_too_large"),
    ],
)
def test_oversized_bodies_are_refused_in_the_proxy(served, before, report, case, total, chunked, key, status, code):
    ahead = serve_processes()
    got, reply, seconds, sent = _upload(served["base"], total, chunked, key)
    time.sleep(0.5)
    after = serve_processes()
    growth = {name: after[name][1] - ahead[name][1] for name in ahead if name in after}
    report.append({"case": case, "status": got, "code": code, "seconds": round(seconds, 3),
                   "sent_mb": sent // MB, "rss_growth_mb": growth})  # fmt: skip
    assert got == status and f'"{code}"'.encode() in reply, "refused (the connection is closed right after it)"
    assert seconds < FAST_S
    assert sent < total, "refused while the client was still sending"
    assert max(growth.values()) < 100, growth


def test_headers_that_never_end_are_cut_at_the_front_door(served):
    """A client that sends part of its headers and then nothing holds a connection of the front door; HAProxy gives
    it ``HEADERS_S`` (Serve's template: an hour), then answers 408 and closes (services/platform/haproxy_launch.py)."""
    host, port = served["base"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nAuthorization: Bearer {API_KEY}\r\n".encode())
    start = time.perf_counter()
    reply = read_reply(sock, HEADERS_S + 20)
    assert status_of(reply) == 408 and time.perf_counter() - start < HEADERS_S + 5, reply[:200]


def test_a_body_trickled_after_an_early_answer_gets_the_answer_and_the_connection_closed(served):
    """The ingress answers 415 on the headers, its body unread; the client then trickles the rest one byte at a time.
    The answer comes whole, and the connection closes under the arrival rule (``body_read_grace_s`` 10 s, then 64 KiB/s)
    — before the guard drained and closed, the HTTP server kept reading such a body at the client's pace, the
    connection open past 45 s (measured)."""
    host, port = served["base"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: prism\r\nContent-Type: text/plain\r\n" \
           f"Authorization: Bearer {API_KEY}\r\nContent-Length: {2 * MB}\r\n\r\n"  # fmt: skip
    sock.sendall(head.encode() + b"x" * (64 << 10))
    start, reply = time.perf_counter(), b""
    while time.perf_counter() - start < 30:
        try:
            sock.sendall(b"x")
        except OSError:
            break
        if select.select([sock], [], [], 2)[0]:
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    closed_s = time.perf_counter() - start
    sock.close()
    assert status_of(reply) == 415 and error_code(reply) == "unsupported_media_type", reply[:300]
    assert closed_s < 20, f"the connection stayed open {closed_s:.1f} s"


def test_defaults_of_unsupported_parameters_and_vendor_fields_are_served(served, before):
    defaults = {"logprobs": False, "n": 1, "tools": [], "response_format": {"type": "text"}, "presence_penalty": 0}
    response, _ = _send(served["base"], KEY, _body(vendor_extension=SECRET, **defaults))
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]
    lines = [json.loads(line) for line in served["request_log"].read_text().splitlines()]
    mine = next(line for line in lines if line["request_id"] == response.json()["id"])
    assert mine["spans"][0]["attrs"]["ignored_fields"] == ["vendor_extension"]


def test_grpc_refusals(served, before, report):
    channel = grpc.insecure_channel(f"127.0.0.1:{served['grpc']}", options=[("grpc.max_send_message_length", 200 * MB)])
    stub = prism_pb2_grpc.PrismStub(channel)
    route = (("application", "prism"),)
    keyed = (*route, ("authorization", f"Bearer {API_KEY}"))
    grpc.channel_ready_future(channel).result(timeout=30)
    warm = prism_pb2.GenerateRequest(chat_completion_json=json.dumps(_body()))
    assert stub.Generate(warm, metadata=keyed, timeout=60).finish_reason  # the first call sets up the route
    cases = [
        ("gRPC: no API key", json.dumps(_body()), route, grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key"),
        ("gRPC: key only in the message", json.dumps(_body()), route, grpc.StatusCode.UNAUTHENTICATED,
         "invalid_api_key"),
        ("gRPC: 120 MB message without a key", "x" * (120 * MB), route, grpc.StatusCode.UNAUTHENTICATED,
         "invalid_api_key"),
        ("gRPC: JSON nested 5,000 deep", "[" * 5000 + "]" * 5000, keyed, grpc.StatusCode.INVALID_ARGUMENT,
         "json_too_deep"),
        ("gRPC: tools", json.dumps(_body(tools=[{"type": "function"}])), keyed, grpc.StatusCode.INVALID_ARGUMENT,
         "invalid_tools"),
        ("gRPC: lone surrogate", '{"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "\\ud800"}]}',
         keyed, grpc.StatusCode.INVALID_ARGUMENT, "invalid_json"),
        ("gRPC: 120 MB message", "x" * (120 * MB), keyed, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    ]  # fmt: skip
    try:
        for case, payload, metadata, want, code in cases:
            start = time.perf_counter()
            key = API_KEY if case == "gRPC: key only in the message" else ""  # (a proxy that knows keys wants metadata)
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(prism_pb2.GenerateRequest(chat_completion_json=payload, api_key=key), metadata=metadata,
                              timeout=30)  # fmt: skip
            seconds = time.perf_counter() - start
            report.append({"case": case, "status": info.value.code().name, "code": code, "seconds": round(seconds, 3)})
            assert info.value.code() == want, info.value.details()
            if code:
                assert json.loads(info.value.details())["error"]["code"] == code
            assert seconds < (GRPC_BULK_S if "120 MB" in case else FAST_S)
    finally:
        channel.close()


def test_after_the_corpus_nothing_restarted_nothing_leaked_and_service_answers(served, before):
    # runs last in this module (pytest keeps file order)
    response, _ = _send(served["base"], KEY, _body())
    assert response.status_code == 200
    after = serve_processes()
    assert {n: p for n, (p, _) in after.items()} == {n: p for n, (p, _) in before.items()}, "no process restarted"
    log = served["request_log"].read_text()
    assert SECRET not in log.replace(f'"gpt-{SECRET}"', "")
    assert log.strip() and not server_errors(served["request_log"]), "no request ended in a 5xx"
    assert SECRET not in served["log"].read_text(), "nothing the client sent reaches the service's logs"


def test_refusals_are_counted_where_they_happen(served, before):
    """The proxy's 413s and the ingress's 4xx both land in ``prism_requests_total`` (Ray exports every ~10 s); the
    proxy's front door counts the places it gave keyed requests as the application's admission stage ``front``."""

    requests = "ray_prism_requests_total"

    def counts(samples: list) -> tuple[float, ...]:
        return (
            total(samples, requests, deployment="proxy", code="request_too_large", status="413"),
            total(samples, requests, deployment="proxy", code="invalid_api_key", status="401"),
            total(samples, requests, deployment="Ingress", code="unsupported_parameter"),
            total(samples, requests, deployment="Ingress", code="invalid_response_format"),
            total(samples, requests, deployment="Ingress", code="invalid_tools"),
            total(samples, "ray_prism_admission_total", application="prism", stage="front", result="admitted"),
        )

    def arrived(samples: list) -> bool:
        proxy, keyless, ingress, grammar, tools, front = counts(samples)
        return proxy >= 3 and keyless >= 4 and ingress >= 4 and grammar >= 7 and tools >= 4 and front >= 1

    url = f"http://127.0.0.1:{served['metrics']}/metrics"
    proxy, keyless, ingress, grammar, tools, front = counts(wait_for(url, arrived, timeout=60))
    assert proxy == 3, "each oversized HTTP body with a key refused by the proxy is counted once"
    assert keyless >= 4, "requests without a valid key are refused (and counted) by the proxy"
    assert ingress >= 4 and grammar >= 7  # (the corpus's unsupported parameters; its output constraints refused)
    assert tools >= 4, tools  # (its malformed tools: three over HTTP, one over gRPC)
    assert front >= 1, "keyed HTTP requests take their place at the proxy's front door (counted in the proxy)"


def test_a_refusal_closed_with_the_body_unread_arrives_whole_every_time(served):
    """The guard refuses these uploads before reading a byte of them and closes with their bytes unread (a reset).
    Its answer is written as one segment (services/platform/whole_answer.py); split in head and body, HAProxy
    forwarded the head and lost the body to the reset 11 times in 150 for the 401 and once in 150 for the 413
    (measured before the fix, 0 in 450 after). 50 of each make a return of the split a likely failure here. (After the
    count of refusals above: these add to it.)"""
    lost = []
    for _ in range(50):
        for size, key, code in ((150 * MB, False, "invalid_api_key"), (300 * MB, True, "request_too_large")):
            _, reply, _, _ = _upload(served["base"], size, chunked=False, key=key)
            if error_code(reply) != code:
                lost.append(reply[:160])
    assert not lost, lost[:3]
