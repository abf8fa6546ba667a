"""An answer given with request bytes unread goes out as one segment (``TCP_CORK`` while it is written), under the very
server the front door runs in: uvicorn, on uvloop (Ray's loop in every actor) and on asyncio's own loop. What the cork
prevents — HAProxy forwarding a refusal's head and losing its body to the reset of the close — is measured against
the deployed app (``tests/security/test_hostile_requests.py``); here: the socket is found, corked while the answer is
written and uncorked before the server closes it, and the client gets the answer whole."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from common.config import PrismConfig
from services.platform import proxy_http
from services.platform.guard_settings import GuardSettings
from services.platform.proxy_http import ProxyGuard
from services.platform.whole_answer import socket_of, whole_answer
from tests.rawhttp import error_code, read_reply, status_of

MB = 1 << 20


def _cork(sock) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)


class _Serving:
    """A real uvicorn server on 127.0.0.1 in a thread of its own, on ``loop``."""

    def __init__(self, app, loop: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, loop=loop, lifespan="off", log_level="critical", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> _Serving:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _upload_unread(port: int, key: str | None = None) -> bytes:
    """A 64 MiB declared upload of which 2 MiB are sent before the answer is read: the server answers and closes with
    body bytes unread (a reset)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n{auth}Content-Length: {64 * MB}\r\n\r\n"
    sock.sendall(head.encode())
    try:
        sock.sendall(b"x" * (2 * MB))
    except OSError:  # answered and reset already (or no answer in 10 s: the reply check below fails)
        pass
    return read_reply(sock, 10)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_answer_is_corked_while_written_and_uncorked_before_the_close(loop):
    seen: dict = {}
    body = b'{"error":{"code":"nope"}}'
    head = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]

    async def app(scope, receive, send):
        sock = socket_of(send)
        seen["found"] = sock is not None
        with whole_answer(send):
            seen["corked"] = _cork(sock)
            await send({"type": "http.response.start", "status": 400, "headers": head})
            await send({"type": "http.response.body", "body": body})
            seen["still_corked"] = _cork(sock)
        seen["uncorked_open"] = _cork(sock)  # (raises if the server had closed it already)
        await asyncio.sleep(0)

    with _Serving(app, loop) as served:
        reply = _upload_unread(served.port)
    assert seen == {"found": True, "corked": 1, "still_corked": 1, "uncorked_open": 0}
    assert status_of(reply) == 400 and error_code(reply) == "nope", reply


def test_outside_uvicorn_it_sends_as_before():
    sent = []

    async def send(message):
        sent.append(message)

    async def answer():
        with whole_answer(send):
            await send({"type": "http.response.start", "status": 401, "headers": []})

    asyncio.run(answer())
    assert socket_of(send) is None and len(sent) == 1


def test_the_guards_refusal_of_an_unread_upload_goes_out_corked(monkeypatch):
    """The guard's 401 for an upload without a key (no body byte read) is written corked, and arrives whole."""
    corked = []
    real = proxy_http.whole_answer

    @contextmanager
    def recording(send):
        with real(send):
            sock = socket_of(send)
            corked.append(_cork(sock) if sock is not None else None)
            yield

    monkeypatch.setattr(proxy_http, "whole_answer", recording)
    cfg = PrismConfig.model_validate({"server": {"api_keys": {"sk-alpha": "alpha"}}})
    guard = ProxyGuard(_never_called, GuardSettings.of([("prism", "/", cfg)]), on_refusal=lambda *_: None)
    with _Serving(guard, "uvloop") as served:
        reply = _upload_unread(served.port)
    assert status_of(reply) == 401 and error_code(reply) == "invalid_api_key", reply
    assert corked == [1]


async def _never_called(scope, receive, send):
    raise AssertionError("the application was called for a request the guard refuses")
