"""The ingress's front door, in-process (the monolith harness: the real ingress class over ASGI): a request holds its
tenant's in-flight place while its body is still arriving, the replica's body bytes in flight are bounded, hostile
bodies (width bombs, lone surrogates) are refused before they cost anything, and a legitimate maximum-size body
stalls the event loop for less than half a second."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest

from common.config import PrismConfig
from loadtest.servers.monolith import build

TEXT = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 4}


def _config(model_cache: str, **extra) -> dict:
    return {"model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1}, **extra}


class _SlowBody:
    """A request body that sends its first part, then waits for ``go`` before the rest (an upload in progress)."""

    def __init__(self, raw: bytes) -> None:
        self.raw, self.go, self.started = raw, asyncio.Event(), asyncio.Event()

    async def __aiter__(self):
        half = len(self.raw) // 2
        yield self.raw[:half]
        self.started.set()
        await self.go.wait()
        yield self.raw[half:]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prism", timeout=120)


def test_a_body_still_arriving_holds_its_tenants_place(model_cache):
    """With ``max_in_flight: 1`` a second request of the tenant is refused 429 while the first one's body is still
    being uploaded (its place was taken from the headers), and gets in once the first one is answered."""
    app = build(_config(model_cache, admission={"default_tenant": {"max_in_flight": 1}}))
    quotas = app.state.ingress.quotas

    async def scenario() -> None:
        raw = json.dumps(TEXT).encode()
        slow = _SlowBody(raw)
        async with _client(app) as http:
            first = asyncio.ensure_future(
                http.post("/v1/chat/completions", content=slow, headers={"content-type": "application/json"})
            )
            await asyncio.wait_for(slow.started.wait(), 30)
            assert quotas.in_flight() == {"default": 1}
            refused = await http.post("/v1/chat/completions", json=TEXT)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_quota_exceeded"
            slow.go.set()
            assert (await first).status_code == 200
            assert (await http.post("/v1/chat/completions", json=TEXT)).status_code == 200
        assert quotas.in_flight() == {"default": 0}

    asyncio.run(scenario())


def test_an_upload_that_fails_gives_its_place_back(model_cache):
    app = build(_config(model_cache, admission={"default_tenant": {"max_in_flight": 1}}))

    async def scenario() -> None:
        async with _client(app) as http:
            bad = await http.post("/v1/chat/completions", content=b'{"x": "\\ud800"}')
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            assert (await http.post("/v1/chat/completions", json=TEXT)).status_code == 200
        assert app.state.ingress.quotas.in_flight() == {"default": 0}

    asyncio.run(scenario())


def test_the_replicas_body_bytes_in_flight_are_bounded(model_cache):
    """Two bodies that would hold more than ``server.max_body_bytes_in_flight`` between them: the second is refused
    429 ``server_overloaded`` with Retry-After before a byte of it is read, and the room comes back."""
    app = build(_config(model_cache, server={"max_body_bytes_in_flight": 4096}))
    ingress = app.state.ingress
    padded = json.dumps({**TEXT, "pad": "x" * 3000}).encode()

    async def scenario() -> None:
        slow = _SlowBody(padded)
        headers = {"content-type": "application/json", "content-length": str(len(padded))}
        async with _client(app) as http:
            first = asyncio.ensure_future(http.post("/v1/chat/completions", content=slow, headers=headers))
            await asyncio.wait_for(slow.started.wait(), 30)
            assert ingress.bodies.held == len(padded)
            refused = await http.post("/v1/chat/completions", content=padded, headers=headers)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_overloaded"
            assert int(refused.headers["retry-after"]) >= 1
            slow.go.set()
            assert (await first).status_code == 200
            assert ingress.bodies.held == 0
            assert (await http.post("/v1/chat/completions", content=padded, headers=headers)).status_code == 200

    asyncio.run(scenario())


def test_a_width_bomb_and_a_lone_surrogate_are_400s_and_cost_nothing(model_cache):
    app = build(_config(model_cache))
    bomb = b'{"model": "prism-tiny-llava", "messages": [], "x": [' + b"{}," * 3_000_000 + b"{}]}"
    surrogate = json.dumps({**TEXT, "messages": [{"role": "user", "content": "\ud800"}]}, ensure_ascii=True)

    async def scenario() -> None:
        async with _client(app) as http:
            start = time.monotonic()
            wide = await http.post("/v1/chat/completions", content=bomb, headers={"content-type": "application/json"})
            assert time.monotonic() - start < 1.0
            assert wide.status_code == 400 and wide.json()["error"]["code"] == "json_too_wide"
            bad = await http.post(
                "/v1/chat/completions", content=surrogate.encode(), headers={"content-type": "application/json"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
            assert (await http.post("/v1/chat/completions", json=TEXT)).status_code == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("items", [8])
def test_a_maximum_size_body_stalls_the_ingress_event_loop_under_half_a_second(model_cache, items):
    """A body at the limit that is mostly base64 (``items`` data URLs filling ``media.max_request_bytes``) through the
    ingress — read, parsed (in a worker thread: ``json.loads`` holds the GIL all the same), validated, tokenised, keyed
    for routing, its chain issued — while a ticker on the ingress's event loop measures its longest gap. The media
    stage (its own process when deployed) answers at once here, so what is measured is the ingress's own cost."""
    from common.errors import InvalidMedia

    cfg = PrismConfig.model_validate(_config(model_cache))
    app = build(_config(model_cache))

    async def refuse(refs, ctx):
        raise InvalidMedia("not an image (the stand-in media stage refuses everything)")

    app.state.stages[0].process = refuse
    per_item = cfg.media.max_request_bytes // items - 4096  # (within the request cap, data-URL prefixes included)
    url = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * (per_item - 4)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}} for _ in range(items)]
    raw = json.dumps({**TEXT, "messages": [{"role": "user", "content": content}]}).encode()
    assert len(raw) >= 0.97 * cfg.body_limit  # (the rest of the limit is the text allowance)

    async def scenario() -> tuple[int, float]:
        gaps, stop = [0.0], asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        async with _client(app) as http:
            answer = await http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        stop.set()
        await ticker
        return answer.status_code, max(gaps)

    status, stall = asyncio.run(scenario())
    print(
        f"maximum-size body ({len(raw) / 2**20:.1f} MiB, {items} items): longest event-loop stall {stall * 1000:.0f} ms"
    )
    assert status == 400  # refused by the stand-in media stage, after everything the ingress does
    assert stall <= 0.5
