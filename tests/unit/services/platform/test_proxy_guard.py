"""The body bound installed in Serve's HTTP proxy, driven through ASGI in-process (the deployed path:
``tests/security/test_hostile_requests.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.platform.proxy_guard import ENV_MAX_BODY_BYTES, BodyLimit, middlewares, ray_env


class _App:
    def __init__(self) -> None:
        self.calls = 0
        self.body = b""

    async def __call__(self, scope, receive, send):
        self.calls += 1
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _run(headers, chunks, limit=100):
    app, refusals, sent, pulled = _App(), [], [], []
    guard = BodyLimit(app, max_bytes=limit, on_refusal=lambda: refusals.append(1))
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        pulled.append(1)
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": headers}
    asyncio.run(guard(scope, receive, send))
    return app, refusals, sent, len(pulled)


def test_declared_length_over_the_limit_is_refused_before_reading():
    app, refusals, sent, pulled = _run([(b"content-length", b"101")], [b"x" * 101])
    assert app.calls == 0 and pulled == 0 and refusals == [1]
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")


def test_declared_length_within_the_limit_streams_through():
    app, refusals, sent, _ = _run([(b"content-length", b"100")], [b"a" * 60, b"b" * 40])
    assert app.calls == 1 and app.body == b"a" * 60 + b"b" * 40 and not refusals
    assert sent[0]["status"] == 200


def test_chunked_body_over_the_limit_never_reaches_the_app():
    app, refusals, sent, pulled = _run([], [b"x" * 60, b"x" * 60, b"x" * 60])
    assert app.calls == 0 and refusals == [1] and sent[0]["status"] == 413
    assert pulled == 2, "reading stops at the chunk that crosses the limit"


def test_chunked_body_within_the_limit_arrives_whole():
    app, refusals, sent, _ = _run([(b"transfer-encoding", b"chunked")], [b"x" * 50, b"y" * 50])
    assert app.calls == 1 and app.body == b"x" * 50 + b"y" * 50 and not refusals and sent[0]["status"] == 200


def test_other_scopes_pass_untouched():
    app, seen = _App(), []

    async def lifespan(scope, receive, send):
        seen.append(scope["type"])

    guard = BodyLimit(lifespan, max_bytes=1, on_refusal=lambda: None)
    asyncio.run(guard({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"] and app.calls == 0


def test_the_callback_reads_the_limit_when_called(monkeypatch):
    monkeypatch.setenv(ENV_MAX_BODY_BYTES, "12345")
    (mw,) = middlewares()
    assert mw.cls is BodyLimit and mw.kwargs["max_bytes"] == 12345
    env = ray_env(12345)
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "services.platform.proxy_guard:middlewares"
    assert int(env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) > 12345


def test_serve_accepts_what_the_callback_returns(monkeypatch):
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    monkeypatch.delenv(ENV_MAX_BODY_BYTES, raising=False)
    (mw,) = validate_http_proxy_callback_return(middlewares())
    from common.config import PrismConfig

    assert mw.kwargs["max_bytes"] == PrismConfig().body_limit


@pytest.mark.parametrize("value", [b"abc", b"-1", b""])
def test_malformed_content_length_is_left_to_the_http_server(value):
    app, refusals, _, _ = _run([(b"content-length", value)], [b"x" * 10])
    assert app.calls == 1 and not refusals


def test_content_length_beside_transfer_encoding_is_not_trusted():
    """RFC 9112: Transfer-Encoding frames the body, so a small Content-Length must not let a big body through."""
    app, refusals, sent, _ = _run([(b"content-length", b"10"), (b"transfer-encoding", b"chunked")], [b"x" * 60] * 3)
    assert app.calls == 0 and refusals == [1] and sent[0]["status"] == 413


def test_a_client_gone_mid_upload_runs_nothing():
    app, guard_refusals, sent = _App(), [], []
    guard = BodyLimit(app, max_bytes=100, on_refusal=lambda: guard_refusals.append(1))
    messages = [{"type": "http.request", "body": b"x" * 10, "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(guard({"type": "http", "method": "POST", "headers": []}, receive, send))
    assert app.calls == 0 and not sent and not guard_refusals
