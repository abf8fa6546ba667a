"""Every grouped topology (``E/PD``, ``EP/D``, ``EPD``) in one process — the ingress and each deployment's object as
its replica would hold it (:mod:`loadtest.servers.monolith` follows ``deployments.topology``) — against the reference
pipeline, which equals transformers' ``generate()`` (``tests/unit/common/reference/test_exactness.py``): LLaVA text
and image, Qwen2-VL image and video, greedy, token for token. The grouped hops show in the trace as in-process
transfers; a group reserves the request's KV on its own pool before its prefill computes, and a full pool refuses
before any prefill work; nothing stays held."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest

from common.config.topology import groups
from common.media.synthetic import synthetic_image, video_bytes
from common.protocol.handoff import MediaRef, RequestContext
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from loadtest.servers.monolith import build
from tests.mediakit import png_bytes
from tests.reference import media_tokens
from tests.unit.services.ingress.test_inprocess_pipeline import _LosingDecode

LLAVA, QWEN = "prism-tiny-llava", "prism-tiny-qwen2vl"
GROUPED = ["E/PD", "EP/D", "EPD", "ME/P/D", "ME/PD", "MEPD"]
IMAGE = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(120, 90, seed=3))).decode()
VIDEO = "data:video/mp4;base64," + base64.b64encode(video_bytes(1.0, fps=10)).decode()
TEXT = "Describe it."


def _config(model_cache: str, topology: str, **extra) -> dict:
    models = [
        {"model": name, "cache_dir": model_cache, "torch_threads": 1, "deployments": {"topology": topology}}
        for name in (LLAVA, QWEN)
    ]
    return {"models": models, **extra}


def _body(model: str, media: tuple[str, str] | None = None, max_tokens: int = 10) -> dict:
    content: list[dict] = [{"type": "text", "text": TEXT}]
    if media is not None:
        kind, url = media
        content.insert(0, {"type": f"{kind}_url", f"{kind}_url": {"url": url}})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }


async def _ask(app, body: dict, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=120) as http:
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
    await asyncio.sleep(0.05)  # (the streams the ingress closed finish in this loop)
    return response


def _decodes(app) -> list:
    """Every decode stage object of the app (alone, or inside its group)."""
    out = []
    for obj in app.state.stages:
        decode = getattr(obj, "decode", None)
        if decode is not None and not callable(decode):
            out.append(decode)
        elif type(obj).__name__ == "DecodeDeployment":
            out.append(obj)
    return out


def _nothing_held(app) -> None:
    for decode in _decodes(app):
        assert not decode.engine.num_running and not decode.engine.num_waiting and not decode.engine.num_reserved
        decode.pool.check_no_leaks()


@pytest.fixture(scope="module")
def references(model_cache, reference_llava, reference_qwen):
    sampling = SamplingParams(max_tokens=10)
    text = [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]
    return {
        (LLAVA, None): list(run_request(reference_llava, text, [], sampling).output.token_ids),
        (LLAVA, "image"): media_tokens(reference_llava, MediaRef("image", IMAGE), TEXT, sampling),
        (QWEN, "image"): media_tokens(reference_qwen, MediaRef("image", IMAGE), TEXT, sampling),
        (QWEN, "video"): media_tokens(reference_qwen, MediaRef("video", VIDEO), TEXT, sampling),
    }


@pytest.fixture(scope="module", params=GROUPED)
def app(request, model_cache):
    return request.param, build(_config(model_cache, request.param))


def test_each_topology_gives_the_reference_tokens(app, references):
    topology, served = app
    media = {None: None, "image": ("image", IMAGE), "video": ("video", VIDEO)}

    async def ask_all() -> list[httpx.Response]:  # (one event loop: the stages' drivers live in it)
        return [await _ask(served, _body(model, media[kind]), **{"x-prism-trace": "1"}) for model, kind in references]

    for ((model, kind), expected), response in zip(references.items(), asyncio.run(ask_all()), strict=True):
        assert response.status_code == 200, (topology, model, kind, response.text)
        assert response.json()["choices"][0]["token_ids"] == expected, (topology, model, kind)
        spans = {s["name"]: s for s in response.json()["prism_trace"]["spans"]}

        def backend(a: str, b: str) -> str:  # (a hop within a group is a call; between groups, the transport)
            return "in_process" if any(a in g and b in g for g in groups(topology)) else "object_store"

        # (the KV crossed in process: one copy into the pool)
        assert spans["decode.transfer"]["attrs"]["backend"] == backend("prefill", "decode")
        if kind is not None:
            assert spans["encode.transfer"]["attrs"]["backend"] == backend("media", "encode")
            assert spans["prefill.transfer"]["attrs"]["backend"] == backend("encode", "prefill")
        if kind is None and backend("prefill", "decode") == "in_process":
            assert "decode.reserve" in spans, "a text request's reservation shows in its trace"
    _nothing_held(served)


def test_a_group_reserves_kv_on_its_own_pool_before_prefill_computes(model_cache):
    """``EPD`` with a small pool: a request the pool cannot hold waits or is refused 429 before its prefill computes
    (like the split topology's reservation through the decode deployment), then is answered once blocks free."""
    config = _config(model_cache, "EPD", engine={"kv_pool_blocks": 16, "max_prompt_tokens": 100})
    served = build(config)
    group = served.state.stages[1]  # (LLaVA's: its media stage, then its one group)
    assert type(group).__name__ == "GroupDeployment" and group.group == ("encode", "prefill", "decode")

    async def computed() -> int:
        return (await group.prefill.stats())["computed_tokens"]

    async def scenario():
        fillers = [RequestContext(f"filler-{i}", "t", time.time() + 60, time.time()) for i in range(2)]
        for ctx in fillers:  # two requests' reservations hold the whole pool
            await group.decode.reserve(ctx, 8)
        before = await computed()
        refused = await _ask(served, _body(LLAVA), **{"x-prism-deadline-ms": "500"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_overloaded", refused.text
        assert await computed() == before, "no prefill work for a request its KV could not be reserved for"
        waiting = asyncio.ensure_future(_ask(served, _body(LLAVA), **{"x-prism-deadline-ms": "20000"}))
        for _ in range(200):
            if group.decode.pool.num_waiting:
                break
            await asyncio.sleep(0.02)
        assert not waiting.done() and await computed() == before
        await group.decode.unreserve(fillers[0])
        answered = await asyncio.wait_for(waiting, 60)
        assert answered.status_code == 200 and await computed() > before
        await group.decode.unreserve(fillers[1])

    asyncio.run(scenario())
    _nothing_held(served)


@pytest.mark.parametrize("topology", ["ME/P/D", "MEPD"])
def test_media_in_a_group_holds_no_kv_and_no_prefill_until_it_is_done(model_cache, topology):
    """With media grouped with encode, a slow download (the group's media stage still working) holds no decode
    blocks and starts no prefill — whether the ingress reserves the KV (``ME/P/D``) or the group does (``MEPD``); once
    the media is done the request is answered with the reference pipeline's path (media → encode in process)."""
    served = build(_config(model_cache, topology))
    group = served.state.stages[0]  # (LLaVA's: no media deployment of its own, its ME group first)
    assert type(group).__name__ == "GroupDeployment" and group.group[:2] == ("media", "encode")
    decode = _decodes(served)[0]
    prefill = group.prefill or served.state.stages[1]
    real_process, real_reserve, real_prefill = group.media.process, decode.reserve, prefill.prefill
    entered, gate, order = asyncio.Event(), asyncio.Event(), []

    async def slow_process(*args):
        entered.set()
        await gate.wait()
        out = await real_process(*args)
        order.append("media")
        return out

    async def counted_reserve(*args):
        order.append("reserve")
        return await real_reserve(*args)

    async def counted_prefill(*args):
        order.append("prefill")
        return await real_prefill(*args)

    group.media.process, decode.reserve, prefill.prefill = slow_process, counted_reserve, counted_prefill

    async def scenario():
        asking = asyncio.ensure_future(_ask(served, _body(LLAVA, ("image", IMAGE)), **{"x-prism-trace": "1"}))
        await asyncio.wait_for(entered.wait(), 30)  # the media stage is "downloading"
        await asyncio.sleep(0.3)
        assert not asking.done() and order == [] and decode.engine.num_reserved == 0
        gate.set()
        answered = await asyncio.wait_for(asking, 60)
        assert answered.status_code == 200, answered.text
        assert order == ["media", "reserve", "prefill"]
        spans = {s["name"]: s for s in answered.json()["prism_trace"]["spans"]}
        assert spans["encode.transfer"]["attrs"]["backend"] == "in_process"

    asyncio.run(scenario())
    _nothing_held(served)


@pytest.mark.parametrize("topology", ["ME/PD", "MEPD"])
def test_a_client_that_leaves_while_its_groups_media_downloads_leaves_nothing_held(model_cache, topology):
    """The client goes away while the group's media stage is downloading: the download stops, the media stage holds
    nothing (no call in flight, no pixels in its budget), and no KV was reserved or prefill computed."""
    import threading

    served = build(_config(model_cache, topology))
    group = served.state.stages[0]
    media = group.media
    real_fetch, started = media._fetch, threading.Event()

    def hanging_fetch(refs, timings, stop):  # (a download that never ends, until the caller goes)
        started.set()
        while stop.left() is None or stop.left() > 0:
            stop.check("download")
            time.sleep(0.01)
        return real_fetch(refs, timings, stop)

    media._fetch = hanging_fetch

    async def scenario():
        asking = asyncio.ensure_future(_ask(served, _body(LLAVA, ("image", IMAGE)), **{"x-prism-deadline-ms": "30000"}))
        for _ in range(500):
            if started.is_set():
                break
            await asyncio.sleep(0.01)
        assert started.is_set() and media.in_flight == 1 and not asking.done()
        asking.cancel()  # (the client went away)
        await asyncio.gather(asking, return_exceptions=True)
        for _ in range(200):
            if not media.in_flight:
                break
            await asyncio.sleep(0.02)
        assert media.in_flight == 0 and media.admission.gate.used == 0
        for decode in _decodes(served):
            assert decode.engine.num_reserved == 0

    asyncio.run(scenario())
    _nothing_held(served)


def test_a_client_that_leaves_a_grouped_stream_frees_its_kv(model_cache):
    """A stream cancelled mid-way (the client went away) ends its sequence in the group's decode engine: its blocks
    go back at once."""
    served = build(_config(model_cache, "E/PD"))

    async def scenario():
        transport = httpx.ASGITransport(app=served)
        body = {**_body(LLAVA, max_tokens=200), "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(transport=transport, base_url="http://prism", timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = 0
                async for line in response.aiter_lines():
                    lines += line.startswith("data: {")
                    if lines >= 3:
                        break
        for _ in range(100):
            if not any(d.engine.num_running for d in _decodes(served)):
                break
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    _nothing_held(served)


@pytest.mark.parametrize("topology", ["E/PD", "EPD", "ME/PD", "MEPD"])
def test_a_lost_group_replica_mid_stream_is_migrated_unseen(model_cache, topology):
    """The group's stream dies after its start (which carries the first token) and four tokens more: the ingress issues
    the chain again with the five tokens the client has (a new prefill, the decode replaying them), and the answer is
    the undisturbed one, token for token."""
    served = build(_config(model_cache, topology))
    client = served.state.ingress.clients[LLAVA]
    body = {**_body(LLAVA, ("image", IMAGE), max_tokens=16), "stream": True}
    group = next(obj for obj in served.state.stages if getattr(obj, "decode", None) is not None)  # (the stream's)

    async def calm_then_disturbed():
        calm = await _ask(served, {**body, "stream": False})
        losing = _LosingDecode(client.chain.of["decode"], after=5, method="run_stream")
        for stage in group.group:
            client.chain.of[stage] = losing
        got = await _ask(served, body, **{"x-prism-trace": "1"})
        return calm.json()["choices"][0], got

    calm, got = asyncio.run(calm_then_disturbed())
    assert got.status_code == 200
    ids, finals = [], []
    for line in got.text.splitlines():
        if line.startswith("data: {"):
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
                if choice.get("finish_reason"):
                    finals.append(chunk)
    assert ids == calm["token_ids"] and len(ids) == 16
    moved = [(m["after_tokens"], m["outcome"]) for m in finals[-1]["prism_trace"]["migrations"]]
    assert moved == [(5, "resumed")]
    assert group.decode.engine.replayed == 5 and group.decode.engine.replay_mismatches == 0
    _nothing_held(served)


def test_a_caller_that_leaves_while_its_group_waits_for_kv_leaves_nothing_held(model_cache):
    """``EPD`` with a full pool: the request's reservation waits in the group's pool queue; the client goes away —
    the wait ends, nothing is reserved for it, prefill computed nothing, and the pool is whole once the others go."""
    served = build(_config(model_cache, "EPD", engine={"kv_pool_blocks": 16, "max_prompt_tokens": 100}))
    group = served.state.stages[1]

    async def scenario():
        fillers = [RequestContext(f"filler-{i}", "t", time.time() + 60, time.time()) for i in range(2)]
        for ctx in fillers:
            await group.decode.reserve(ctx, 8)
        before = (await group.prefill.stats())["computed_tokens"]
        asking = asyncio.ensure_future(_ask(served, _body(LLAVA), **{"x-prism-deadline-ms": "30000"}))
        for _ in range(300):
            if group.decode.pool.num_waiting:
                break
            await asyncio.sleep(0.02)
        assert group.decode.pool.num_waiting == 1 and not asking.done()
        asking.cancel()  # (the client went away)
        await asyncio.gather(asking, return_exceptions=True)
        for _ in range(100):
            if not group.decode.pool.num_waiting:
                break
            await asyncio.sleep(0.02)
        assert group.decode.pool.num_waiting == 0 and group.decode.engine.num_reserved == 2
        assert (await group.prefill.stats())["computed_tokens"] == before
        for ctx in fillers:
            await group.decode.unreserve(ctx)

    asyncio.run(scenario())
    _nothing_held(served)


def test_a_group_autoscales_on_the_busiest_stage_that_has_a_target(model_cache):
    """The group's queue depth is its last stage's, and that of any other stage whose target is set, each scaled to
    the group's target: prompt tokens are never read against the sequences' default target."""
    from services.stages.group import GroupDeployment

    def depth(prefill_target: dict) -> dict[str, float]:
        deployments = {"decode": {"target_queue_per_replica": 4}, "prefill": prefill_target}
        raw = {"model": {"model": LLAVA, "cache_dir": model_cache, "torch_threads": 1}, "deployments": deployments}
        group = GroupDeployment(raw, ("prefill", "decode"))
        group.prefill.record_autoscaling_stats = lambda: {"queue_depth": 100.0}  # prompt tokens queued
        group.decode.record_autoscaling_stats = lambda: {"queue_depth": 3.0, "kv_used_fraction": 0.5}  # sequences
        return group.record_autoscaling_stats()

    assert depth({}) == {"kv_used_fraction": 0.5, "queue_depth": 3.0}, "prefill's tokens have no target: not counted"
    assert depth({"target_queue_per_replica": 50}) == {"kv_used_fraction": 0.5, "queue_depth": 8.0}  # 100 × 4 / 50

    # media counts without a target of its own (as a media deployment scales on its requests in flight by default)
    raw = {"model": {"model": LLAVA, "cache_dir": model_cache, "torch_threads": 1},
           "deployments": {"decode": {"target_queue_per_replica": 8}}}  # fmt: skip
    group = GroupDeployment(raw, ("media", "encode", "prefill", "decode"))
    group.media.record_autoscaling_stats = lambda: {"queue_depth": 6.0}  # downloads in flight (default target 4)
    group.encode.record_autoscaling_stats = lambda: {"queue_depth": 500.0}  # patches: no target, not counted
    group.prefill.record_autoscaling_stats = lambda: {"queue_depth": 100.0}
    group.decode.record_autoscaling_stats = lambda: {"queue_depth": 2.0}
    assert group.record_autoscaling_stats() == {"queue_depth": 12.0}  # 6 × 8 / 4


def test_an_encode_error_is_not_held_back_by_a_waiting_reservation(model_cache):
    """``EPD``: encode fails while the request's reservation waits in a full pool — the client gets the encoder's
    error at once, not at the reservation's grant or deadline, and the waiting reservation goes back."""
    from common.errors import Overloaded

    served = build(_config(model_cache, "EPD", engine={"kv_pool_blocks": 32}))
    group = served.state.stages[1]

    async def failing_encode(*args):
        await asyncio.sleep(0.2)
        raise Overloaded("the encoder is full", retry_after_s=1)

    group.encode.encode = failing_encode

    async def scenario():
        fillers = [RequestContext(f"filler-{i}", "t", time.time() + 60, time.time()) for i in range(2)]
        for ctx in fillers:  # (the image request's 11 blocks must wait)
            await group.decode.reserve(ctx, 16)
        start = time.monotonic()
        answer = await _ask(served, _body(LLAVA, ("image", IMAGE)), **{"x-prism-deadline-ms": "30000"})
        took = time.monotonic() - start
        assert answer.status_code == 429 and "encoder is full" in answer.text, answer.text
        assert took < 5, took  # (the reservation would have waited up to the 30 s deadline)
        assert group.decode.pool.num_waiting == 0 and group.decode.engine.num_reserved == 2
        for ctx in fillers:
            await group.decode.unreserve(ctx)

    asyncio.run(scenario())
    _nothing_held(served)


def test_hops_that_leave_a_group_go_over_nixl_with_the_reference_tokens(model_cache, references):
    """``server.transport: nixl`` (UCX on this CPU, the agents in one process): in ``EP/D`` the group's prefill sends
    its KV over NIXL to the decode deployment; in ``E/PD`` the encoder's embeddings go over NIXL into the group, whose
    KV stays in process. Token for token the reference's."""
    topologies = {LLAVA: "EP/D", QWEN: "E/PD"}
    models = [
        {"model": name, "cache_dir": model_cache, "torch_threads": 1, "deployments": {"topology": topologies[name]}}
        for name in (LLAVA, QWEN)
    ]
    served = build({"models": models, "server": {"transport": "nixl"}})

    async def ask_all() -> list[httpx.Response]:
        bodies = [_body(LLAVA), _body(LLAVA, ("image", IMAGE)), _body(QWEN, ("image", IMAGE))]
        return [await _ask(served, body, **{"x-prism-trace": "1"}) for body in bodies]

    cases = [(LLAVA, None), (LLAVA, "image"), (QWEN, "image")]
    for (model, kind), response in zip(cases, asyncio.run(ask_all()), strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == references[(model, kind)], (model, kind)
        spans = {s["name"]: s.get("attrs", {}) for s in response.json()["prism_trace"]["spans"]}
        if model == LLAVA:  # EP/D: the KV leaves the group over NIXL
            assert spans["decode.transfer"]["backend"] == "nixl"
        else:  # E/PD: the embeddings arrive over NIXL, the KV stays in the group
            assert spans["prefill.transfer"]["backend"] == "nixl"
            assert spans["decode.transfer"]["backend"] == "in_process"
    _nothing_held(served)


def test_the_trace_names_the_kv_reservation_wherever_it_was_taken():
    """``routing.decode`` comes from the stream's start: a group reserves in its own replica, the ingress's reserver
    in the context the decode stage gets (the served tests check both through Serve: ``tests.served``)."""
    from dataclasses import replace

    from common.protocol.handoff import StreamStart
    from services.ingress.chain import Started

    ctx = RequestContext("r", "t", time.time() + 60, time.time())
    by_group = Started([], ctx, StreamStart((1, 2), replica="group-1", reservation="waited"))
    assert by_group.decode_route == ("waited", "group-1")
    reserved = replace(ctx, decode_replica="decode-2", reservation="reserved")
    by_ingress = Started([], reserved, StreamStart((1, 2), replica="decode-2", reservation="reserved"))
    assert by_ingress.decode_route == ("reserved", "decode-2")
    assert Started([], ctx, StreamStart((1, 2), replica="decode-3")).decode_route is None  # (none taken)
