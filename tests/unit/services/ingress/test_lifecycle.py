"""The ingress request lifecycle: one place taken and given back, one outcome recorded, whatever the path."""

from __future__ import annotations

import asyncio
import logging

import pytest

from common.config import ObservabilityConfig
from common.errors import InvalidRequestError, Overloaded
from services.ingress.lifecycle import InFlight, Outcome, RequestLifecycle
from services.ingress.observer import RequestObserver


class _Stream:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


class _Call:
    """The shape of :class:`services.ingress.call_stream.Call` the lifecycle uses: ``close`` cancels the chain."""

    def __init__(self) -> None:
        self.stream, self.kv_blocks = _Stream(), 3

    def close(self) -> None:
        self.stream.cancel()


@pytest.fixture
def parts():
    loads: list[int] = []
    places = InFlight(limit=1, retry_after_s=2, on_change=loads.append)
    return RequestObserver(ObservabilityConfig(request_log=False)), places, loads


def _run(coro):
    return asyncio.run(coro)


def test_ok_closes_once_and_gives_the_place_back(parts):
    observer, places, loads = parts

    async def go():
        life = RequestLifecycle(observer, places, "http", traced=False)
        async with life:
            life.call = _Call()
            assert places.count == 1
        return life

    life = _run(go())
    assert life.outcome is Outcome.OK and (life.trace.status, life.trace.code) == (200, "ok")
    assert places.count == 0 and loads == [1, 0]
    assert life.call.stream.cancels == 1
    life.close(RuntimeError("late"))  # a later close changes nothing
    assert life.outcome is Outcome.OK and places.count == 0 and life.call.stream.cancels == 1


def test_at_capacity_is_refused_without_taking_a_place(parts):
    observer, places, _ = parts

    async def go():
        first = RequestLifecycle(observer, places, "http", traced=False)
        async with first:
            second = RequestLifecycle(observer, places, "grpc", traced=False)
            with pytest.raises(Overloaded):
                async with second:
                    raise AssertionError("never entered")
            assert places.count == 1
        return second

    second = _run(go())
    assert second.outcome is Outcome.REFUSED and second.trace.status == 429
    assert places.count == 0


def test_typed_and_unexpected_errors(parts, caplog):
    observer, places, _ = parts

    async def go(exc):
        life = RequestLifecycle(observer, places, "http", traced=True)
        with pytest.raises(type(exc)):
            async with life:
                raise exc
        return life

    refused = _run(go(InvalidRequestError("bad", param="stop")))
    assert refused.outcome is Outcome.REFUSED and refused.error.code == "invalid_request"
    with caplog.at_level(logging.ERROR, logger="prism.ingress"):
        failed = _run(go(ValueError("the client's secret stop string")))
    assert failed.outcome is Outcome.FAILED and (failed.error.http_status, failed.error.code) == (500, "internal_error")
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "ValueError" in logged and "test_lifecycle.py" in logged, "5xx logged with its traceback"
    assert "secret" not in logged, "never the exception's text, which may quote the request"
    assert failed.summary() is not None and places.count == 0


def test_cancelled_and_detached(parts):
    observer, places, _ = parts

    async def cancelled():
        life = RequestLifecycle(observer, places, "http", traced=False)
        with pytest.raises(asyncio.CancelledError):
            async with life:
                raise asyncio.CancelledError
        return life

    life = _run(cancelled())
    assert life.outcome is Outcome.CANCELLED and life.trace.status == 499 and places.count == 0

    async def detached():
        life = RequestLifecycle(observer, places, "http", traced=False)
        async with life:
            life.detach()
        assert life.outcome is None and places.count == 1, "a detached lifecycle stays open for the response body"
        life.abandon()
        return life

    life = _run(detached())
    assert life.outcome is Outcome.CANCELLED and places.count == 0


@pytest.mark.parametrize("make", ["task", "request", "disconnect"])
def test_cancellations_serve_raises_as_exceptions_are_cancellations(parts, make):
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError
    from starlette.requests import ClientDisconnect

    exc = {"task": TaskCancelledError(), "request": RequestCancelledError("r"), "disconnect": ClientDisconnect()}[make]
    observer, places, _ = parts

    async def go():
        life = RequestLifecycle(observer, places, "http", traced=False)
        with pytest.raises(type(exc)):
            async with life:
                raise exc
        return life

    life = _run(go())
    assert life.outcome is Outcome.CANCELLED and life.error is None and life.trace.status == 499
    assert places.count == 0


def test_a_failing_close_still_gives_the_place_back(parts):
    observer, places, _ = parts

    class Broken:
        kv_blocks = 0

        @staticmethod
        def close():
            raise RuntimeError("cancel failed")

    async def go():
        life = RequestLifecycle(observer, places, "http", traced=False)
        await life.__aenter__()
        life.call = Broken()
        with pytest.raises(RuntimeError):
            life.close()
        return life

    _run(go())
    assert places.count == 0


@pytest.mark.parametrize("shown", [False, True])
def test_client_traces_carry_cache_outcomes_only_when_configured(shown):
    observer = RequestObserver(ObservabilityConfig(request_log=False, trace_cache_hits=shown))
    places = InFlight(limit=1, retry_after_s=2, on_change=lambda _: None)

    async def go():
        life = RequestLifecycle(observer, places, "http", traced=True)
        async with life:
            life.trace.timeline.span("encode", 0.01, encoder_cache_hits=1, visual_tokens=144)
        return life

    life = _run(go())
    summary = life.summary()
    assert ("cache" in summary) == shown
    (encode,) = [s for s in summary["spans"] if s["name"] == "encode"]
    assert ("encoder_cache_hits" in encode["attrs"]) == shown and encode["attrs"]["visual_tokens"] == 144
    assert RequestLifecycle(observer, places, "http", traced=False).summary() is None


def test_a_replica_lost_upstream_is_a_503_like_any_replica_loss():
    """Serve wraps an upstream replica's death in a RayServeException: still 503 ``stage_unavailable``; a
    RayServeException for anything else stays a 500."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import RayServeException

    from services.ingress.failures import replica_lost, typed_error

    wrapped = RayServeException("Request to deployment 'Decode' failed: an upstream actor died")
    wrapped.__cause__ = RayActorError()
    assert replica_lost(wrapped) is wrapped.__cause__
    assert (typed_error(wrapped, 2).http_status, typed_error(wrapped, 2).code) == (503, "stage_unavailable")
    other = RayServeException("something else")
    assert replica_lost(other) is None and typed_error(other, 2).http_status == 500
