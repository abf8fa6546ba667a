"""The ingress and every stage class in one process (the monolith harness, no Ray), with the KV hand-off through the
fake transport: the same tokens as the object store, typed events end to end, and an injected hand-off fault gives
a typed 500 that frees everything and leaves the next request unaffected."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from dataclasses import replace

import httpx
import pytest

from common.kv.transport.fake import FakeTransport
from common.protocol.handoff import StreamStart
from loadtest.servers.monolith import build
from tests.mediakit import png_bytes

BODY = {
    "model": "prism-tiny-llava",
    "messages": [{"role": "user", "content": "Count to five."}],
    "max_tokens": 12,
    "temperature": 0,
    "return_token_ids": True,
}


def _config(model_cache: str) -> dict:
    return {"model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1}}


async def _ask(app, body=BODY, stream=False, traced=False, settle=False) -> httpx.Response:
    """One request through the app's ASGI interface; ``traced`` asks for the trace, ``settle`` waits a moment after
    the answer so that the streams the ingress cancelled close in this event loop."""
    transport = httpx.ASGITransport(app=app)
    headers = {"x-prism-trace": "1"} if traced else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=60) as http:
        response = await http.post("/v1/chat/completions", json={**body, "stream": stream}, headers=headers)
    if settle:
        await asyncio.sleep(0.1)
    return response


def _nothing_held(decode) -> None:
    """No sequence, no reservation, no lease, no block left in the decode stage."""
    assert not decode.engine.num_running and not decode.engine.num_waiting and not decode.engine.num_reserved
    decode.pool.check_no_leaks()


@pytest.fixture(scope="module")
def apps(model_cache):
    fake = FakeTransport()
    return build(_config(model_cache)), build(_config(model_cache), transport=fake), fake


def test_fake_transport_gives_the_object_store_tokens(apps):
    store_app, fake_app, fake = apps
    via_store = asyncio.run(_ask(store_app))
    via_fake = asyncio.run(_ask(fake_app))
    assert via_store.status_code == via_fake.status_code == 200
    ids = via_store.json()["choices"][0]["token_ids"]
    assert via_fake.json()["choices"][0]["token_ids"] == ids and len(ids) == 12
    assert fake.fetches >= 1 and fake.release() == 0, "read hand-offs are released"


def test_streamed_answer_equals_unary(apps):
    _, fake_app, _ = apps
    unary = asyncio.run(_ask(fake_app)).json()
    streamed = asyncio.run(_ask(fake_app, stream=True))
    assert streamed.status_code == 200
    text = ""
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    assert text == unary["choices"][0]["message"]["content"]
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_a_lost_handoff_is_issued_again_like_a_lost_replica(apps):
    """The sender of a KV hand-off went away before it was read (its replica died mid-transfer): the chain is issued
    again before the first token — the same tokens, nothing left leased or reserved."""
    store_app, fake_app, fake = apps
    want = asyncio.run(_ask(store_app)).json()["choices"][0]["token_ids"]
    fake.inject("lose")
    again = asyncio.run(_ask(fake_app, settle=True))
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want
    assert not fake.faults
    _nothing_held(fake_app.state.stages[3])


@pytest.mark.parametrize("fault", ["truncate", "corrupt", "stale"])
def test_handoff_fault_is_a_typed_500_and_frees_everything(apps, fault):
    _, fake_app, fake = apps
    fake.inject(fault)
    failed = asyncio.run(_ask(fake_app))
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "invalid_handoff"
    decode = fake_app.state.stages[3]
    _nothing_held(decode)
    ok = asyncio.run(_ask(fake_app))
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 12


def test_without_the_receivers_check_a_corrupted_handoff_would_be_a_200(apps, monkeypatch):
    """What the seal guards against (vllm#52234's shape of failure): an altered KV payload decodes cleanly."""
    import services.stages.decode

    _, fake_app, fake = apps
    monkeypatch.setattr(services.stages.decode, "check_landed", lambda pre, landed: None)
    fake.inject("corrupt")
    assert asyncio.run(_ask(fake_app)).status_code == 200


def test_the_first_token_rides_in_the_streams_start(model_cache):
    """The decode engine has a sequence's first token (prefill's) by the time its stream starts, so the start carries
    it: a Serve stream sends one item less before the first token. The answer is the same token for token, the trace
    has the first token's ``decode.queue`` once, and a one-token answer is the start alone."""
    from common.protocol.handoff import StreamToken

    app = build(_config(model_cache), transport=FakeTransport())
    decode = app.state.stages[3]
    real, streams = decode.generate, []

    async def recording(*args):
        streams.append([])
        async for event in real(*args):
            streams[-1].append(event)
            yield event

    decode.generate = recording

    async def six_then_one():  # (one event loop: the app's engine locks belong to it)
        return await _ask(app, {**BODY, "max_tokens": 6}, traced=True), await _ask(app, {**BODY, "max_tokens": 1})

    six, one = (r.json() for r in asyncio.run(six_then_one()))
    (start, *rest), (alone,) = streams
    assert isinstance(start, StreamStart) and isinstance(start.first, StreamToken)
    assert [s.name for s in start.first.spans] == ["decode.queue"] and all(isinstance(e, StreamToken) for e in rest)
    assert [start.first.token_id, *(e.token_id for e in rest)] == six["choices"][0]["token_ids"]
    assert len(rest) == 5 and [s["name"] for s in six["prism_trace"]["spans"]].count("decode.queue") == 1
    assert isinstance(alone, StreamStart) and alone.first.finish_reason == "length"
    assert one["choices"][0]["token_ids"] == [alone.first.token_id] and one["choices"][0]["finish_reason"] == "length"
    _nothing_held(decode)


def test_engines_step_on_threads_of_their_own(model_cache, monkeypatch):
    """As in Prism, where each stage is a process: every engine steps in its own thread, never in the loop's shared
    pool, where media fetch/decode (and the hand-off's fetches) run — the monolith baseline must not queue its image
    work behind engine steps (or the reverse) and call it the price of having no stages."""
    from common.engine.decode import DecodeEngine
    from common.engine.encode import EncodeEngine
    from common.engine.prefill import PrefillEngine

    seen: dict[str, set[str]] = {"encode": set(), "prefill": set(), "decode": set()}
    for stage, cls in (("encode", EncodeEngine), ("prefill", PrefillEngine), ("decode", DecodeEngine)):

        def recording(self, *args, _step=cls.step, _stage=stage):
            seen[_stage].add(threading.current_thread().name)
            return _step(self, *args)

        monkeypatch.setattr(cls, "step", recording)
    app = build(_config(model_cache))
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]
    answer = asyncio.run(_ask(app, {**BODY, "messages": [{"role": "user", "content": content}]}))
    assert answer.status_code == 200, answer.text
    assert all(seen.values()), seen
    assert seen["encode"] == {"prism-encode_0"} and seen["decode"] == {"prism-decode_0"}
    assert all(name.startswith("prism-prefill-") for name in seen["prefill"]), seen


class _LosingDecode:
    """The decode handle, except that its next ``losses`` streams die after ``after`` events: like a killed replica
    (the call is gone, its sequence freed, the ingress sees ``RayActorError``) or, with ``unreachable``, like a
    replica the ingress cannot reach (``ActorUnavailableError``) whose call runs on until the ingress cancels it.
    ``method``: the streaming method that loses (a grouped deployment's is ``run_stream``); ``bare``: its start comes
    without the first token it carries (as when the sequence waited for its KV lease), so that a loss after the start
    is one before the first token."""

    def __init__(
        self,
        handle,
        after: int,
        losses: int = 1,
        unreachable: bool = False,
        upstream: bool = False,
        method: str = "generate",
        bare: bool = False,
    ) -> None:
        self.handle, self.after, self.losses, self.unreachable = handle, after, losses, unreachable
        self.upstream, self.method, self.bare = upstream, method, bare
        self.on_loss = lambda: None
        self.dying: list[_DyingStream] = []

    def __getattr__(self, name):
        if name == self.__dict__.get("method"):  # (the losing method: its options and remote are this object's)
            return self
        return getattr(self.handle, name)

    def options(self, stream: bool = False):
        return self

    def remote(self, *args):
        stream = getattr(self.handle, self.method).options(stream=True).remote(*args)
        if self.losses <= 0:
            return stream
        self.losses -= 1
        self.dying.append(_DyingStream(stream, self.after, self.unreachable, self.on_loss, self.upstream, self.bare))
        return self.dying[-1]


class _DyingStream:
    def __init__(self, stream, after: int, unreachable: bool, on_loss, upstream: bool = False, bare: bool = False):
        self.stream, self.left, self.unreachable, self.on_loss = stream, after, unreachable, on_loss
        self.upstream, self.bare = upstream, bare
        self.cancelled = False
        self.failed: BaseException | None = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import ActorUnavailableError, RayActorError

        if self.left == 0:
            self.on_loss()
            if self.unreachable:  # the sequence still runs there: only the ingress's cancel frees it
                raise ActorUnavailableError("replica unreachable", None)
            self.stream.cancel()
            await asyncio.sleep(0)  # the cancelled generator closes: its sequence leaves the engine
            if not self.upstream:
                raise RayActorError()
            # what Serve raises when a call's upstream replica died (e.g. prefill's, under the decode call)
            from ray.serve.exceptions import RayServeException

            self.failed = RayServeException("Request to deployment 'Decode' failed: an upstream actor died")
            self.failed.__cause__ = RayActorError()
            raise self.failed
        self.left -= 1
        event = await self.stream.__anext__()
        return replace(event, first=None) if self.bare and isinstance(event, StreamStart) else event

    def cancel(self) -> None:
        self.cancelled = True
        self.stream.cancel()
        if self.failed is not None:  # Serve's cancel() of a failed call re-raises its error
            raise self.failed


def _stream_tokens(response: httpx.Response) -> tuple[str, list[int], list[dict]]:
    text, ids, finals = "", [], []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                ids += choice.get("token_ids") or []
            if "error" in chunk or any(c.get("finish_reason") for c in chunk.get("choices", [])):
                finals.append(chunk)
    return text, ids, finals


@pytest.fixture
def losing(model_cache):
    """A fresh app per test (its engine locks belong to the one event loop the test runs in) whose decode handle
    can be told to lose streams."""
    app = build(_config(model_cache), transport=FakeTransport())
    client = app.state.ingress.clients["prism-tiny-llava"]
    client.metrics = app.state.counted = _Counted()
    real = client.chain.of["decode"]

    def lose(
        after: int, losses: int = 1, unreachable: bool = False, upstream: bool = False, bare: bool = False
    ) -> _LosingDecode:
        client.chain.of["decode"] = _LosingDecode(real, after, losses, unreachable, upstream, bare=bare)
        return client.chain.of["decode"]

    return app, lose


class _Counted:
    """Stands in for the ingress's metrics: what was counted, by name and tags."""

    def __init__(self) -> None:
        self.counts: dict[tuple, float] = {}

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        key = (name, *sorted(tags.items()))
        self.counts[key] = self.counts.get(key, 0) + value

    def migrations(self) -> dict[str, float]:
        return {dict(k[1:])["outcome"]: v for k, v in self.counts.items() if k[0] == "prism_migrations_total"}


@pytest.mark.parametrize(
    "stream, after, unreachable, bare",
    [
        (True, 1, False, True),
        (True, 5, False, False),
        (False, 1, False, True),
        (False, 5, False, False),
        (True, 5, True, False),
    ],
    ids=["streamed-before-first-token", "streamed-after-5", "unary-before-first-token", "unary-after-5", "unreachable"],
)
def test_a_lost_decode_replica_is_migrated_unseen(losing, stream, after, unreachable, bare):
    """The decode stream dies after its start (which carries the first token, unless ``bare``) and more tokens: the
    answer is the undisturbed one, token for token, the trace lists the migration, nothing is replayed differently and
    no KV is left behind — also when the lost replica's call was still running (only the ingress cancelling the lost
    attempt frees it)."""
    app, lose = losing
    sent = 0 if bare else after  # (the start and each item after it: one token each)
    body = {**BODY, "max_tokens": 16}
    decode = app.state.stages[3]

    async def calm_then_disturbed():
        calm = await _ask(app, body)
        losing = lose(after, unreachable=unreachable, bare=bare)
        got = await _ask(app, body, stream, traced=True, settle=True)
        assert losing.dying[0].cancelled, "the lost attempt's chain is cancelled (an unreachable replica runs on)"
        return calm.json()["choices"][0], got

    calm, got = asyncio.run(calm_then_disturbed())
    assert got.status_code == 200
    if stream:
        text, ids, finals = _stream_tokens(got)
        trace = finals[-1]["prism_trace"]
    else:
        choice = got.json()["choices"][0]
        text, ids, trace = choice["message"]["content"], choice["token_ids"], got.json()["prism_trace"]
    assert ids == calm["token_ids"] and len(ids) == 16
    assert text == calm["message"]["content"]
    cause = "ActorUnavailableError" if unreachable else "RayActorError"
    moved = [(m["after_tokens"], m["cause"], m["outcome"]) for m in trace["migrations"]]
    assert moved == [(sent, cause, "resumed")]
    assert app.state.counted.migrations() == {"resumed": 1}
    assert decode.engine.replayed == sent
    assert decode.engine.replay_mismatches == 0
    _nothing_held(decode)


def test_migrations_are_bounded(losing):
    """More losses than ``server.max_migrations`` (2): after two migrations the third loss ends the stream with a
    typed error event; every token sent before it was new, and no KV is left behind."""
    app, lose = losing
    # each stream: its start and 2 tokens, then the replica is lost. The first start carries the first token; a
    # migrated stream's does not (its next token comes after the replay's steps): 3 tokens, then 2, then 2.
    lose(after=3, losses=3)

    got = asyncio.run(_ask(app, {**BODY, "max_tokens": 16}, stream=True, traced=True, settle=True))
    _, _, finals = _stream_tokens(got)
    error = finals[-1]
    assert error["error"]["code"] == "stage_unavailable"
    trace = error["prism_trace"]
    assert [m["after_tokens"] for m in trace["migrations"]] == [3, 5] and trace["output_tokens"] == 7
    assert app.state.counted.migrations() == {"resumed": 2, "refused": 1}
    decode = app.state.stages[3]
    assert decode.engine.replayed == 3 + 5 and decode.engine.replay_mismatches == 0
    _nothing_held(decode)


def test_a_loss_after_the_deadline_is_a_504_not_a_migration(losing, monkeypatch):
    """No time left when the replica is lost: 504 ``deadline_exceeded`` (not a 503), counted as refused."""
    import types

    import services.ingress.call_stream as cs

    app, lose = losing
    late = {"by": 0.0}
    monkeypatch.setattr(cs, "time", types.SimpleNamespace(time=lambda: time.time() + late["by"]))
    lose(after=3).on_loss = lambda: late.update(by=10_000.0)  # the loss is seen only past the deadline

    got = asyncio.run(_ask(app, {**BODY, "max_tokens": 16}, settle=True))
    assert got.status_code == 504 and got.json()["error"]["code"] == "deadline_exceeded"
    assert app.state.counted.migrations() == {"refused": 1}
    decode = app.state.stages[3]
    _nothing_held(decode)


@pytest.mark.parametrize("after", [0, 5], ids=["before-the-start", "mid-stream"])
def test_an_upstream_replica_lost_under_the_decode_call_is_a_replica_loss(losing, after):
    """Serve reports a chain whose upstream replica died as a ``RayServeException`` caused by the actor's death,
    and re-raises it from ``cancel()``: the chain is issued again (before the start) or migrated (mid-stream) — a
    200 with the undisturbed tokens, never a 500."""
    app, lose = losing
    body = {**BODY, "max_tokens": 16}

    async def calm_then_disturbed():
        calm = await _ask(app, body)
        lose(after, upstream=True)
        got = await _ask(app, body, traced=True, settle=True)
        return calm.json()["choices"][0], got

    calm, got = asyncio.run(calm_then_disturbed())
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == calm["token_ids"]
    expected = {} if after == 0 else {"resumed": 1}  # before the start: a retried attempt, not a migration
    assert app.state.counted.migrations() == expected
    decode = app.state.stages[3]
    _nothing_held(decode)


def test_a_tenant_at_its_cap_is_refused_before_its_body_is_read(model_cache):
    """The tenant is known from the headers: at its cap of requests in flight it gets 429 ``tenant_quota_exceeded``
    without the body being read — a body that is not even JSON gets the 429, not a 400 — and, with room again, the
    same body is judged (400)."""
    config = {**_config(model_cache), "admission": {"default_tenant": {"max_in_flight": 1}}}
    app = build(config, transport=FakeTransport())
    quotas = app.state.ingress.quotas
    held = quotas.enter("default")  # another request of the tenant

    async def post_garbage() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=60) as http:
            return await http.post("/v1/chat/completions", content=b"{not json", headers={"x-prism-trace": "1"})

    refused = asyncio.run(post_garbage())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_quota_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    quotas.release(held)
    judged = asyncio.run(post_garbage())
    assert judged.status_code == 400
    assert quotas.in_flight() == {"default": 0}


def test_kv_is_reserved_before_prefill_computes(model_cache):
    """A full decode pool holds a request back before any prefill work: refused 429 with Retry-After when it cannot
    wait (the prefill stage computed nothing for it), or waiting until blocks free (still nothing computed), then
    answered; an image request the media stage refuses gives its reservation back. Nothing is left held."""
    from common.protocol.handoff import RequestContext

    config = {**_config(model_cache), "engine": {"kv_pool_blocks": 16, "max_prompt_tokens": 100}}
    app = build(config, transport=FakeTransport())
    _, _, prefill, decode = app.state.stages

    async def computed() -> int:
        return (await prefill.stats())["computed_tokens"]

    async def post(http, body, deadline_ms):
        return await http.post("/v1/chat/completions", json=body, headers={"x-prism-deadline-ms": str(deadline_ms)})

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=60) as http:
            fillers = [RequestContext(f"filler-{i}", "t", time.time() + 60, time.time()) for i in range(2)]
            for ctx in fillers:  # two requests whose chains have not reached prefill yet hold the whole pool
                await decode.reserve(ctx, 8)
            before = await computed()
            refused = await post(http, BODY, 500)  # it would wait ~1 s (no drain rate yet): past its deadline
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "server_overloaded"
            assert "KV blocks" in refused.json()["error"]["message"] and int(refused.headers["retry-after"]) >= 1
            assert await computed() == before
            waiting = asyncio.ensure_future(post(http, BODY, 10_000))
            for _ in range(200):  # until its reservation waits in the pool's queue
                if decode.pool.num_waiting:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert not waiting.done() and decode.pool.num_waiting == 1 and await computed() == before
            await decode.unreserve(fillers[0])  # one chain failed: its blocks go to the waiting request
            answered = await asyncio.wait_for(waiting, 30)
            assert answered.status_code == 200 and await computed() > before
            await decode.unreserve(fillers[1])
            image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
            content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]
            too_long = await post(http, {**BODY, "messages": [{"role": "user", "content": content}]}, 10_000)
            assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "prompt_too_long"
            await asyncio.sleep(0.1)  # (the ingress gives the reservation back without waiting for the answer)
        _nothing_held(decode)

    asyncio.run(scenario())


def test_a_request_with_media_reserves_no_kv_and_starts_no_encode_until_its_media_is_done(model_cache):
    """A slow download (the media stage still working) holds no decode blocks, no decode request slot and no encode
    call; once its items are done the request reserves, encodes and is answered. A media stage that fails gets its
    typed error to the client and leaves nothing held (its failure surfaces in the call that consumes its result, so a
    reservation may be taken for the moment between the two: given back with the failed chain)."""
    app = build(_config(model_cache), transport=FakeTransport())
    from common.errors import MediaFetchFailed

    media, encode, _, decode = app.state.stages
    real_process, real_encode, real_reserve = media.process, encode.encode, decode.reserve
    gate, calls = asyncio.Event(), {"encode": 0, "reserve": 0}

    async def slow_process(*args):
        await gate.wait()
        return await real_process(*args)

    async def counted_encode(*args):
        calls["encode"] += 1
        return await real_encode(*args)

    async def counted_reserve(*args):
        calls["reserve"] += 1
        return await real_reserve(*args)

    media.process, encode.encode, decode.reserve = slow_process, counted_encode, counted_reserve
    image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]
    body = {**BODY, "messages": [{"role": "user", "content": content}]}

    async def scenario():
        asking = asyncio.ensure_future(_ask(app, body))
        await asyncio.sleep(0.5)  # the media stage is "downloading"
        assert not asking.done() and calls == {"encode": 0, "reserve": 0} and decode.engine.num_reserved == 0
        gate.set()
        answered = await asyncio.wait_for(asking, 60)
        assert answered.status_code == 200, answered.text
        assert calls == {"encode": 1, "reserve": 1}

        async def failing_process(*args):
            raise MediaFetchFailed("the download broke")

        media.process = failing_process
        failed = await _ask(app, body, settle=True)
        assert failed.status_code == 422 and failed.json()["error"]["code"] == "media_fetch_failed", failed.text

    asyncio.run(scenario())
    _nothing_held(decode)
