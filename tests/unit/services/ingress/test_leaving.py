"""A decode replica that leaves its deployment (scale-down, rolling update, drain) while it streams: the ingress lets
each stream run on for ``server.drain_grace_s``, then moves the ones still running to a live replica by migration —
the client gets exactly the undisturbed answer, the leaving replica's KV is freed at once — in one process (the
monolith harness), the routers' reports of the replica sets made by hand."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from common.kv.transport.fake import FakeTransport
from loadtest.servers.monolith import build
from services.ingress.failures import ReplicaLeft
from services.routers import replica_sets
from tests.unit.services.ingress.test_inprocess_pipeline import BODY, _ask, _Counted, _nothing_held, _stream_tokens

_ids = itertools.count()


class _SlowStream:
    """The decode stream, each event ``delay`` later: long enough to leave under (the tiny model is fast)."""

    def __init__(self, stream, delay: float) -> None:
        self.stream, self.delay = stream, delay

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        return await self.stream.__anext__()

    def cancel(self) -> None:
        self.stream.cancel()


class _SlowDecode:
    def __init__(self, handle, delay: float) -> None:
        self.handle, self.delay = handle, delay

    def __getattr__(self, name):
        return self if name == "generate" else getattr(self.handle, name)

    def options(self, stream: bool = False):
        return self

    def remote(self, *args):
        return _SlowStream(self.handle.generate.options(stream=True).remote(*args), self.delay)


@pytest.fixture
def leaving(model_cache):
    """``(app, client, decode, deployment)``: a fresh app whose decode replica calls itself ``r1`` (in a deployment
    of ``r1`` and ``r2`` as this process's routers see it), streams slowly, and drains after 0.2 s."""
    cfg = {"model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1},
           "server": {"drain_grace_s": 0.2}}  # fmt: skip
    app = build(cfg, transport=FakeTransport())
    client = app.state.ingress.clients["prism-tiny-llava"]
    client.metrics = app.state.counted = _Counted()
    client.chain.of["decode"] = _SlowDecode(client.chain.of["decode"], 0.02)
    decode = app.state.stages[3]
    decode.replica_id = "r1"
    deployment = f"app-leaving-{next(_ids)}/Decode"
    replica_sets.update(1, deployment, ["r1", "r2"])
    return app, client, decode, deployment


BODY_LONG = {**BODY, "messages": [{"role": "user", "content": "Tell me story number 3, a long one."}], "max_tokens": 48}


async def _streaming(app, client, body=BODY_LONG):
    """Start a streamed request; returns its task once its stream is running (a few tokens out)."""
    task = asyncio.ensure_future(_ask(app, body, stream=True, traced=True, settle=True))
    watch = client.streams.leaving
    for _ in range(500):
        if any(c.decode_replica == "r1" for c in list(watch._calls.values())):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    return task


def _moves(got) -> list[tuple[str, str]]:
    _, _, finals = _stream_tokens(got)
    return [(m["cause"], m["outcome"]) for m in finals[-1]["prism_trace"].get("migrations", [])]


def test_a_stream_on_a_leaving_replica_moves_after_the_grace_unseen(leaving):
    app, client, decode, deployment = leaving

    async def scenario():
        calm = (await _ask(app, BODY_LONG)).json()["choices"][0]
        task = await _streaming(app, client)
        decode.replica_id = "r2"  # (what the re-issued chain's stream will say it runs on)
        replica_sets.update(1, deployment, ["r2"])
        return calm, await task

    calm, got = asyncio.run(scenario())
    assert len(calm["token_ids"]) >= 20, "the prompt's answer is long enough to leave under"
    text, ids, finals = _stream_tokens(got)
    assert got.status_code == 200 and finals[-1]["choices"][0]["finish_reason"] == calm["finish_reason"]
    assert ids == calm["token_ids"] and text == calm["message"]["content"]
    assert _moves(got) == [("ReplicaLeft", "resumed")]
    assert client.streams.leaving.moved == 1 and app.state.counted.migrations() == {"resumed": 1}
    assert decode.engine.replayed >= 1 and decode.engine.replay_mismatches == 0
    _nothing_held(decode)


def test_a_stream_that_ends_within_the_grace_stays(leaving):
    app, client, decode, deployment = leaving
    client.streams.leaving.grace_s = 30.0

    async def scenario():
        task = await _streaming(app, client)
        replica_sets.update(1, deployment, ["r2"])
        return await task

    got = asyncio.run(scenario())
    assert got.status_code == 200 and _moves(got) == [] and client.streams.leaving.moved == 0
    _nothing_held(decode)


def test_with_nowhere_to_go_a_stream_stays_until_a_replica_is_there(leaving):
    """A one-replica stage updated stop-before-start: the stream runs on where it is until the replacement is in the
    set, then moves."""
    app, client, decode, deployment = leaving

    async def scenario():
        task = await _streaming(app, client)
        replica_sets.update(1, deployment, [])
        await asyncio.sleep(0.4)  # twice the grace
        stayed = client.streams.leaving.moved == 0 and not task.done()
        decode.replica_id = "r3"
        replica_sets.update(1, deployment, ["r3"])
        return stayed, await task

    stayed, got = asyncio.run(scenario())
    assert stayed, "nothing moved while no replica could take it"
    assert got.status_code == 200 and _moves(got) == [("ReplicaLeft", "resumed")]
    _nothing_held(decode)


def test_a_replica_that_comes_back_keeps_its_streams(leaving):
    app, client, _, deployment = leaving

    async def scenario():
        task = await _streaming(app, client)
        replica_sets.update(1, deployment, ["r2"])
        await asyncio.sleep(0.05)
        replica_sets.update(1, deployment, ["r1", "r2"])  # (an in-place update took it out for a moment)
        return await task

    got = asyncio.run(scenario())
    assert got.status_code == 200 and _moves(got) == [] and client.streams.leaving.moved == 0


def test_choices_are_not_moved(leaving):
    """``n`` > 1 is never migrated: its streams finish where they are (or end with their replica)."""
    app, client, decode, deployment = leaving

    async def scenario():
        task = await _streaming(app, client, {**BODY_LONG, "n": 2, "temperature": 1, "seed": 3})
        replica_sets.update(1, deployment, ["r2"])
        return await task

    got = asyncio.run(scenario())
    assert got.status_code == 200 and _moves(got) == [] and client.streams.leaving.moved == 0
    _nothing_held(decode)


def test_a_stream_that_starts_on_a_replica_already_gone_is_moved_too(leaving):
    """The ``generate`` was on its way when its replica left: its stream starts there after the departure was heard,
    and is drained like the others."""
    app, client, decode, deployment = leaving
    client.streams.leaving.deployment = deployment  # (as the ingress names its decode deployment)
    replica_sets.update(1, deployment, ["r2"])  # r1 left before the stream started

    async def scenario():
        task = await _streaming(app, client)
        decode.replica_id = "r2"
        return await task

    got = asyncio.run(scenario())
    assert got.status_code == 200 and _moves(got) == [("ReplicaLeft", "resumed")]
    _nothing_held(decode)


def test_a_move_refused_for_a_full_queue_waits_and_asks_again(monkeypatch):
    """A stage at capacity answers a moved stream's chain with 429 (more times than a chain's own retries allow): the
    migration waits and asks again until the deadline, rather than ending a started stream with an error; with no time
    left to wait, the refusal stands."""
    import time
    from types import SimpleNamespace

    from common.errors import Overloaded
    from services.ingress import call_stream
    from services.ingress.call_stream import CallStream

    full = [Overloaded("full", retry_after_s=0.01) for _ in range(4)]
    answers: list = [*full, "started"]
    from common.protocol.handoff import RequestContext, StreamStart
    from services.ingress.chain import Started

    started = Started(["stream"], RequestContext("r", "t", deadline=1e12, sent_at=0.0), StreamStart((1, 2), (), "r2"))

    async def reissue(sent):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return started

    class _Call(SimpleNamespace):  # (the watch holds calls weakly)
        pass

    def call(deadline: float) -> SimpleNamespace:
        return _Call(
            reissue=reissue, ctx=SimpleNamespace(deadline=deadline), migrations=0, sampling=SimpleNamespace(n=1),
            chain=[], prompt_ids=[1, 2], trace=SimpleNamespace(migrated=lambda *a: None), leaving="r1",
        )  # fmt: skip

    streams = CallStream(2, lambda outcome: None)
    moved = call(time.time() + 30)
    asyncio.run(streams._migrate(moved, (5,), ReplicaLeft("r1 left")))
    assert not answers and moved.stream == "stream" and (moved.decode_replica, moved.leaving) == ("r2", None)
    # 20 ms left: the migration starts (its own clock held at that instant, however loaded the machine), the stage
    # refuses, and no backoff (≥ 50 ms) ends before the deadline
    now = time.time()
    monkeypatch.setattr(call_stream, "time", SimpleNamespace(time=lambda: now))
    answers[:] = [Overloaded("full", retry_after_s=0.5), "started"]
    with pytest.raises(Overloaded):  # (no time left to wait: the refusal stands)
        asyncio.run(streams._migrate(call(now + 0.02), (), ReplicaLeft("r1 left")))
    assert answers == ["started"], "not asked again"
