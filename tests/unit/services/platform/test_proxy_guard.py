"""The guard installed in Serve's HTTP proxy, driven through ASGI in-process (the deployed path:
``tests/security/test_hostile_requests.py``): keys before bodies, body bounds, arrival rate, chunked budget, Serve's
control headers."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from common.config import PrismConfig
from services.platform.proxy_guard import ENV_GUARD, ENV_MAX_BODY_BYTES, GuardSettings, middlewares, ray_env
from services.platform.proxy_http import ProxyGuard

KEY = "sk-alpha"


class _App:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls, self.body, self.headers, self.delay_s = 0, b"", [], delay_s
        self.disconnected = False

    async def __call__(self, scope, receive, send):
        self.calls += 1
        self.headers = list(scope.get("headers", ()))
        await asyncio.sleep(self.delay_s)  # (an ingress replica that pulls the body late: the server's wait)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                self.disconnected = True
                break
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def streamed(monkeypatch):
    """Bodies of any declared size stream on to the application (the guard gathers those up to 1 MiB otherwise)."""
    from services.platform import proxy_http

    monkeypatch.setattr(proxy_http, "BUFFER_BYTES", 0)


def _settings(keys: dict | None = None, **server) -> GuardSettings:
    cfg = PrismConfig.model_validate({"server": {"api_keys": keys or {}, "max_body_bytes": 1024, **server}})
    return GuardSettings.of([("prism", "/", cfg)]).model_copy(update={"max_body_bytes": 100})


def _run(headers, chunks, settings=None, method="POST", path="/v1/chat/completions", app=None, gaps=None):
    """One request through the guard: ``chunks`` arrive one per ``receive`` (after ``gaps[i]`` seconds each)."""
    app = app or _App()
    refusals, sent, pulled = [], [], []
    guard = ProxyGuard(app, settings or _settings(), on_refusal=lambda status, code: refusals.append((status, code)))
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        i = len(pulled)
        pulled.append(1)
        if gaps and i < len(gaps):
            await asyncio.sleep(gaps[i])
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that sends nothing more

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 30))
    return app, refusals, sent, len(pulled)


def _error(sent) -> tuple[int, str]:
    return sent[0]["status"], json.loads(sent[1]["body"])["error"]["code"]


def test_declared_length_over_the_limit_is_refused_before_reading():
    app, refusals, sent, pulled = _run([(b"content-length", b"101")], [b"x" * 101])
    assert app.calls == 0 and pulled == 0 and refusals == [(413, "request_too_large")]
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")


@pytest.mark.parametrize("mode", ["gathered", "streamed"])
def test_declared_length_within_the_limit_reaches_the_app(mode, monkeypatch):
    from services.platform import proxy_http

    monkeypatch.setattr(proxy_http, "BUFFER_BYTES", 1 << 20 if mode == "gathered" else 0)
    app, refusals, sent, _ = _run([(b"content-length", b"100")], [b"a" * 60, b"b" * 40])
    assert app.calls == 1 and app.body == b"a" * 60 + b"b" * 40 and not refusals
    assert sent[0]["status"] == 200


def test_a_small_body_trickling_in_never_reaches_the_app():
    """A slow upload of a small body is gathered here: the application is never called, the client gets 408."""
    settings = _settings(body_read_grace_s=0.2, body_min_bytes_per_s=1_000_000)
    app, refusals, sent, _ = _run([(b"content-length", b"20")], [b"x" * 10, b"y" * 10], settings, gaps=[0.0, 3600])
    assert app.calls == 0 and refusals == [(408, "request_timeout")] and _error(sent) == (408, "request_timeout")


def test_chunked_body_over_the_limit_never_reaches_the_app():
    app, refusals, sent, pulled = _run([], [b"x" * 60, b"x" * 60, b"x" * 60])
    assert app.calls == 0 and refusals == [(413, "request_too_large")] and sent[0]["status"] == 413
    assert pulled == 2, "reading stops at the chunk that crosses the limit"


def test_chunked_body_within_the_limit_arrives_whole():
    app, refusals, sent, _ = _run([(b"transfer-encoding", b"chunked")], [b"x" * 50, b"y" * 50])
    assert app.calls == 1 and app.body == b"x" * 50 + b"y" * 50 and not refusals and sent[0]["status"] == 200


def test_other_scopes_pass_untouched():
    seen = []

    async def lifespan(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(ProxyGuard(lifespan, _settings())({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_a_request_without_a_valid_key_is_refused_before_one_body_byte():
    settings = _settings({KEY: "alpha"})
    for auth in ([], [(b"authorization", b"Bearer sk-wrong")], [(b"authorization", b"sk-alpha")]):
        app, refusals, sent, pulled = _run([*auth, (b"transfer-encoding", b"chunked")], [b"x" * 10], settings)
        assert app.calls == 0 and pulled == 0 and refusals == [(401, "invalid_api_key")]
        assert _error(sent) == (401, "invalid_api_key")
    app, refusals, sent, _ = _run(
        [(b"authorization", b"Bearer sk-alpha"), (b"content-length", b"5")], [b"hello"], settings
    )
    assert app.calls == 1 and app.body == b"hello" and not refusals


def test_bodyless_requests_pass_without_a_key_but_may_not_carry_a_body():
    settings = _settings({KEY: "alpha"})
    app, refusals, sent, _ = _run([], [b""], settings, method="GET", path="/health")
    assert app.calls == 1 and not refusals
    app, refusals, sent, pulled = _run([(b"transfer-encoding", b"chunked")], [b"x" * 50], settings, method="GET")
    assert app.calls == 0 and pulled == 0 and _error(sent) == (400, "invalid_request")


def test_serve_control_headers_from_the_client_are_dropped():
    headers = [
        (b"x-request-timeout-seconds", b"0"),
        (b"X-Request-Disconnect-Disabled", b"?1"),
        (b"x-request-id", b"someone-elses"),
        (b"serve_multiplexed_model_id", b"m"),
        (b"x-serve-router-replica", b"r1"),
        (b"x-session-id", b"s"),
        (b"x-prism-trace", b"1"),
        (b"content-length", b"2"),
    ]
    app, _, _, _ = _run(headers, [b"{}"])
    assert [name for name, _ in app.headers] == [b"x-prism-trace", b"content-length"]


def test_a_stalled_chunked_upload_is_a_408():
    settings = _settings(body_read_grace_s=0.2, body_min_bytes_per_s=1_000_000)
    chunks = [b"x" * 10, b"never sent"]
    app, refusals, sent, _ = _run([(b"transfer-encoding", b"chunked")], chunks, settings, gaps=[0.0, 3600])
    assert app.calls == 0 and refusals == [(408, "request_timeout")] and _error(sent) == (408, "request_timeout")


def test_a_body_streaming_too_slowly_is_answered_408_and_the_app_sees_the_client_leave(streamed):
    settings = _settings(body_read_grace_s=0.2, body_min_bytes_per_s=1_000_000)
    app, refusals, sent, _ = _run([(b"content-length", b"20")], [b"x" * 10, b"y" * 10], settings, gaps=[0.0, 3600])
    assert app.calls == 1 and app.disconnected and refusals == [(408, "request_timeout")]
    assert _error(sent) == (408, "request_timeout") and len(sent) == 2  # the app's own answer was dropped


def test_time_the_server_spends_not_reading_does_not_count_against_the_client():
    """An ingress that pulls the body late (queued behind other requests) waits on nobody: the client's bytes are
    already there, and the body arrives in time."""
    settings = _settings(body_read_grace_s=0.2, body_min_bytes_per_s=1_000_000)
    app, refusals, sent, _ = _run([(b"content-length", b"4")], [b"late"], settings, app=_App(delay_s=0.5))
    assert app.body == b"late" and not refusals and sent[0]["status"] == 200


def _held(nbytes: int, release: asyncio.Event):
    """A chunked upload's ``receive``: ``nbytes``, then nothing until ``release``, then its end."""
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"a" * nbytes, "more_body": True}
        await release.wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


async def _sixty_bytes():
    return {"type": "http.request", "body": b"b" * 60, "more_body": False}


def test_chunked_uploads_share_a_budget_per_proxy():
    settings = _settings().model_copy(update={"chunked_bytes_in_flight": 120})
    guard_app, sent_first, sent_second = _App(), [], []
    guard = ProxyGuard(guard_app, settings, on_refusal=lambda status, code: None)
    release = asyncio.Event()
    slow_receive, fast_receive = _held(80, release), _sixty_bytes

    async def scenario():
        scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"transfer-encoding", b"chunked")]}
        first = asyncio.ensure_future(guard(dict(scope), slow_receive, lambda m: _append(sent_first, m)))
        await asyncio.sleep(0.05)
        assert guard.gathering == 80
        await guard(dict(scope), fast_receive, lambda m: _append(sent_second, m))
        release.set()
        await first
        assert guard.gathering == 0
        await guard(dict(scope), fast_receive, lambda m: _append(sent_second, m))

    asyncio.run(scenario())
    status, code = _error(sent_second)
    assert (status, code) == (503, "server_overloaded") and (b"retry-after", b"1") in sent_second[0]["headers"]
    assert sent_first[0]["status"] == 200 and sent_second[2]["status"] == 200


async def _append(sent: list, message) -> None:
    sent.append(message)


def test_settings_carry_digests_never_keys_and_route_by_the_longest_prefix():
    keyed = PrismConfig.model_validate({"server": {"api_keys": {KEY: "alpha"}}})
    filed = PrismConfig.model_validate({"server": {"api_keys_file": "/keys/api-keys.json"}})
    settings = GuardSettings.of([("prism", "/", keyed), ("other", "/other", filed), ("open", "/open", PrismConfig())])
    env = ray_env(settings)
    assert KEY not in json.dumps(env) and env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == (
        "services.platform.proxy_guard:middlewares"
    )
    assert [r.app for r in settings.routes] == ["prism", "other"]  # an application without keys is not guarded
    assert settings.route("/v1/chat/completions").app == "prism"
    assert settings.route("/other/v1/chat/completions").app == "other" and settings.route("/otherwise").app == "prism"
    assert settings.app("other").keys_file == "/keys/api-keys.json" and settings.app(None) is None
    assert settings.routes[0].key_store().tenant(KEY) == "alpha"
    assert GuardSettings.of([("prism", "/", keyed)], verify_keys=False).routes == []
    assert GuardSettings.from_env(env) == settings


def test_front_places_default_to_what_the_server_the_guard_runs_in_carries():
    cfg = PrismConfig.model_validate(
        {"server": {"max_in_flight_per_ingress": 10}, "deployments": {"ingress": {"max_replicas": 3}}}
    )
    assert GuardSettings.of([("prism", "/", cfg)]).front_places == 30  # a proxy in front of every ingress replica
    assert GuardSettings.of([("prism", "/", cfg)], per_ingress_replica=True).front_places == 10  # behind HAProxy
    explicit = cfg.model_copy(update={"server": cfg.server.model_copy(update={"front_places": 7})})
    assert GuardSettings.of([("prism", "/", explicit)], per_ingress_replica=True).front_places == 7


def test_the_callback_reads_the_settings_when_called(monkeypatch):
    settings = _settings({KEY: "alpha"})
    for name, value in ray_env(settings).items():
        monkeypatch.setenv(name, value)
    (mw,) = middlewares()
    assert mw.cls is ProxyGuard and mw.kwargs["settings"] == settings
    monkeypatch.delenv(ENV_GUARD)
    monkeypatch.setenv(ENV_MAX_BODY_BYTES, "12345")
    (mw,) = middlewares()
    assert mw.kwargs["settings"].max_body_bytes == 12345 and mw.kwargs["settings"].routes == []


@pytest.fixture(autouse=True)
def _restore_grpc_server():
    """``middlewares()`` installs the gRPC guard in this process: put grpc.aio's server constructor back after."""
    import grpc.aio._server as aio_server

    original = aio_server.Server.__init__
    yield
    aio_server.Server.__init__ = original


def test_a_width_bomb_is_refused_as_it_streams_not_after(streamed):
    """``[{},{},…]`` past the structure limit: refused 400 ``json_too_wide`` at the chunk that crosses it — the
    application (streamed) sees the client leave, or (chunked) is never called; the rest is read and dropped before
    the answer goes out, so the connection closes with nothing unread."""
    settings = _settings(max_json_structure=300).model_copy(update={"max_body_bytes": 10_000})
    bomb = [b'{"x": [' + b"{}," * 60, b"{}," * 60, b"{}," * 60, b"{}," * 60, b"{}]}"]
    declared = str(sum(len(c) for c in bomb)).encode()
    app, refusals, sent, pulled = _run([(b"content-length", declared)], bomb, settings)
    assert refusals == [(400, "json_too_wide")] and _error(sent) == (400, "json_too_wide") and app.disconnected
    assert app.body == b"", "the application gets none of it (pieces are joined up to 64 KiB before it gets them)"
    assert pulled == 5, "refused at the third piece (123, 243, then 363 of 300); the last two read and dropped"
    app, refusals, sent, pulled = _run([(b"transfer-encoding", b"chunked")], bomb, settings)
    assert app.calls == 0 and refusals == [(400, "json_too_wide")] and pulled == 5


def test_a_refused_body_is_drained_only_within_the_body_limit_and_the_arrival_rule():
    """After a refusal part-way through, the rest of the body is read only while the body read in all stays within
    ``max_body_bytes`` and keeps to the arrival rule; past either, the answer goes out at once."""
    settings = _settings(max_json_structure=300).model_copy(update={"max_body_bytes": 1_000})
    endless = [b"{}," * 70] * 40  # 210 bytes, 140 counted, each: refused at the third, the limit passed at the fifth
    app, refusals, sent, pulled = _run([(b"transfer-encoding", b"chunked")], endless, settings)
    assert app.calls == 0 and _error(sent) == (400, "json_too_wide") and pulled == 5
    settings = settings.model_copy(update={"body_grace_s": 0.2, "body_min_bytes_per_s": 1_000_000})
    start = time.monotonic()
    app, refusals, sent, pulled = _run([(b"transfer-encoding", b"chunked")], endless, settings, gaps=[0, 0, 0, 3600])
    assert _error(sent) == (400, "json_too_wide") and pulled == 4 and time.monotonic() - start < 5
    image = [b'{"url": "data:image/png;base64,' + b"QUJD" * 20, b'"}']
    app, refusals, sent, _ = _run([(b"content-length", str(sum(map(len, image))).encode())], image, settings)
    assert not refusals and sent[0]["status"] == 200


def test_a_trickled_body_reaches_the_app_in_few_pieces(streamed):
    """100 one-byte pieces of a declared body: the application (each of its receives is a call from the ingress
    replica to the proxy) gets them joined, not one call per piece."""
    received = []

    class _Counting(_App):
        async def __call__(self, scope, receive, send):
            async def counting():
                message = await receive()
                received.append(len(message.get("body", b"")))
                return message

            await super().__call__(scope, counting, send)

    settings = _settings().model_copy(update={"max_body_bytes": 1000})
    app, refusals, _, pulled = _run([(b"content-length", b"100")], [b"x"] * 100, settings, app=_Counting())
    assert app.body == b"x" * 100 and not refusals and pulled == 100 and received == [100]


# ---- the front door: per-tenant shares of the proxy's places (issue 34) --------------------------------------------
class _Held:
    """An application that holds every request until ``go`` is set (reading its body only then)."""

    def __init__(self) -> None:
        self.go, self.tenants = asyncio.Event(), []

    async def __call__(self, scope, receive, send):
        self.tenants.append(dict(scope["headers"])[b"authorization"])
        await self.go.wait()
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_the_front_door_shares_the_proxys_places_between_tenants_before_any_body_is_read():
    """Two places: alpha's flood takes both and queues (its bodies unread), beta still gets in at once; alpha's queue
    past ``front_max_waiting`` is refused 429 with Retry-After; when the requests end, every place is back."""
    keys = {"sk-alpha": "alpha", "sk-beta": "beta"}
    settings = _settings(keys, front_places=2, front_max_waiting=1, retry_after_s=3)
    app, recorded, pulled = _Held(), [], {"alpha": 0, "beta": 0}

    class Sink:
        def inc(self, name, value=1.0, **tags):
            recorded.append((name, tags["stage"], tags["tenant"], tags.get("result"), tags.get("reason")))

        def observe(self, name, value, **tags):
            pass

    guard = ProxyGuard(app, settings, sink=Sink())

    async def request(tenant: str) -> list:
        sent = []

        async def receive():
            pulled[tenant] += 1
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", f"Bearer sk-{tenant}".encode()), (b"content-length", b"2")]
        await guard(
            {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}, receive, send
        )
        return sent

    async def scenario() -> None:
        alpha = [asyncio.ensure_future(request("alpha")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert len(app.tenants) == 2 and pulled["alpha"] == 2  # two in (their bodies gathered), the third's unread
        assert guard.door.in_flight == {("prism", "alpha"): 2}
        refused = await request("alpha")  # its queue is full
        assert _error(refused) == (429, "tenant_share_exceeded")
        assert (b"retry-after", b"3") in refused[0]["headers"]
        beta = asyncio.ensure_future(request("beta"))
        await asyncio.sleep(0.05)
        assert app.tenants[-1] == b"Bearer sk-beta"  # in at once, though both places were held
        app.go.set()
        done = await asyncio.gather(*alpha, beta)
        assert all(sent[0]["status"] == 200 for sent in done)
        assert guard.door.total == 0 and not guard.door.queues

    asyncio.run(asyncio.wait_for(scenario(), 10))
    decisions = [(r[2], r[3], r[4]) for r in recorded if r[0] == "prism_admission_total" and r[1] == "front"]
    assert decisions.count(("alpha", "refused", "tenant_share")) == 1
    assert ("alpha", "admitted", "waited") in decisions and ("beta", "admitted", "immediate") in decisions


def test_one_tenants_chunked_uploads_cannot_lock_another_out_of_the_gathering_budget():
    """Alpha's upload holds the whole budget (120 bytes): alpha's next is refused 503, beta's (within its half) is
    gathered — and a tenant alone is held to the budget (the test above)."""
    keys = {"sk-alpha": "alpha", "sk-beta": "beta"}
    settings = _settings(keys).model_copy(update={"chunked_bytes_in_flight": 120})
    guard = ProxyGuard(_App(), settings, on_refusal=lambda status, code: None)
    release, sent = asyncio.Event(), {"alpha": [], "beta": []}
    held_receive, small_receive = _held(100, release), _sixty_bytes

    def scope(tenant: str) -> dict:
        headers = [(b"transfer-encoding", b"chunked"), (b"authorization", f"Bearer sk-{tenant}".encode())]
        return {"type": "http", "method": "POST", "path": "/", "headers": headers}

    async def scenario():
        first = asyncio.ensure_future(guard(scope("alpha"), held_receive, lambda m: _append([], m)))
        await asyncio.sleep(0.05)
        await guard(scope("alpha"), small_receive, lambda m: _append(sent["alpha"], m))
        await guard(scope("beta"), small_receive, lambda m: _append(sent["beta"], m))
        release.set()
        await first
        assert guard.gathering == 0 and not guard.gathering_by

    asyncio.run(scenario())
    assert _error(sent["alpha"]) == (503, "server_overloaded")
    assert sent["beta"][0]["status"] == 200


class _PumpingApp(_App):
    """An application as Serve's direct ingress runs one: a task of its own pulls ``receive`` while the application
    runs, and is cancelled when the application returns — here after ``answer_s``, with its own 429."""

    def __init__(self, answer_s: float) -> None:
        super().__init__()
        self.answer_s = answer_s

    async def __call__(self, scope, receive, send):
        async def pump():
            while (await receive())["type"] == "http.request":
                pass

        task = asyncio.create_task(pump())
        done, _ = await asyncio.wait([task], timeout=self.answer_s)
        if not done:
            await send({"type": "http.response.start", "status": 429, "headers": []})
            await send({"type": "http.response.body", "body": b"busy"})
        task.cancel()


def test_a_refusal_is_answered_once_the_application_returns_even_if_it_cancels_its_receive(streamed):
    """The width refusal is decided inside ``receive``, but answered (after the drain) by the guard's own task: an
    application that returns — cancelling the task that pulls ``receive`` — while the rest of the body still arrives
    leaves the client one answer, the refusal, not none (uvicorn's 500)."""
    settings = _settings(max_json_structure=300).model_copy(update={"max_body_bytes": 10_000})
    bomb = [b"{}," * 200] + [b"{}," * 20] * 5
    declared = str(sum(map(len, bomb))).encode()
    app = _PumpingApp(answer_s=0.1)
    _, refusals, sent, pulled = _run([(b"content-length", declared)], bomb, settings, app=app, gaps=[0, 0, 0.3])
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]
    assert _error(sent) == (400, "json_too_wide") and refusals == [(400, "json_too_wide")] and pulled == 6


class _Refusing(_App):
    """An application that answers on the headers alone (as the ingress's 415), its body unread."""

    async def __call__(self, scope, receive, send):
        self.calls += 1
        headers = [(b"content-type", b"application/json"), (b"connection", b"keep-alive")]
        await send({"type": "http.response.start", "status": 415, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


def test_an_answer_sent_before_the_body_is_in_goes_out_after_it_and_closes_the_connection(streamed):
    """An application's answer that starts before the body is all in goes out once the application has returned and
    the rest of the body is read and dropped — a trickle not waited for past the arrival rule — with ``Connection:
    close`` (once, replacing its own); an answer after the whole body keeps the application's headers."""
    _, _, sent, pulled = _run([(b"content-length", b"30")], [b"x" * 10, b"y" * 10, b"z" * 10], app=_Refusing())
    assert sent[0]["status"] == 415 and sent[1]["body"] == b"{}" and pulled == 3
    assert [v for k, v in sent[0]["headers"] if k == b"connection"] == [b"close"]
    _, _, sent, _ = _run([(b"content-length", b"20")], [b"x" * 10, b"y" * 10])
    assert sent[0]["status"] == 200 and sent[0]["headers"] == []
    settings = _settings(body_read_grace_s=0.2, body_min_bytes_per_s=1_000_000)
    start = time.monotonic()
    _, _, sent, pulled = _run([(b"content-length", b"30")], [b"x" * 10] * 3, settings, app=_Refusing(), gaps=[0, 3600])
    assert sent[0]["status"] == 415 and pulled == 2 and time.monotonic() - start < 5, "a trickle is not waited for"


def test_two_readers_of_one_body_share_each_piece_and_count_it_once():
    """Serve's reading task may still be waiting for a piece when the guard drains: both get that piece, counted
    once, and the end of the body is seen (none lost)."""
    from services.platform.body_arrival import Arrival

    async def scenario():
        pieces = asyncio.Queue()
        arrival = Arrival(5.0, 1.0)
        first = asyncio.ensure_future(arrival.receive(pieces.get))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(arrival.receive(pieces.get))
        await pieces.put({"type": "http.request", "body": b"x" * 10, "more_body": False})
        got = await asyncio.gather(first, second)
        return got, arrival

    got, arrival = asyncio.run(scenario())
    assert got[0] is got[1] and arrival.received == 10 and arrival.ended and arrival.pending is None


def test_an_early_answer_to_a_client_waiting_for_100_continue_asks_for_no_body(streamed):
    """``Expect: 100-continue`` and no body byte yet: the held answer goes out without a read (a read would have the
    server send ``100 Continue``, and the client its whole body)."""
    headers = [(b"content-length", b"30"), (b"expect", b"100-continue")]
    _, _, sent, pulled = _run(headers, [b"x" * 10] * 3, app=_Refusing())
    assert sent[0]["status"] == 415 and pulled == 0


class _StartsThenReads(_App):
    """An application that starts its answer, then reads the body (its answer held: the body is not in)."""

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive())["type"] == "http.request":
            pass


def test_a_body_refused_after_a_held_start_is_answered_by_the_guard(streamed):
    """The application's start was held (never sent), then the body breaks a limit: the client gets the guard's
    refusal — not nothing (which the HTTP server would turn into a 500)."""
    settings = _settings(max_json_structure=300).model_copy(update={"max_body_bytes": 10_000})
    bomb = [b"{}," * 200, b"{}," * 200]
    declared = str(sum(map(len, bomb))).encode()
    _, refusals, sent, _ = _run([(b"content-length", declared)], bomb, settings, app=_StartsThenReads())
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]
    assert _error(sent) == (400, "json_too_wide") and refusals == [(400, "json_too_wide")]
