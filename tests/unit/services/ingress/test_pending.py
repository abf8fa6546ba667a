"""The ingress's side of a decode call sent before its prefill finished: the prefill's result reference once Serve gave
the call a replica, an in-process call as it is, and a lost upstream replica as the loss it is (re-issued)."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import RayServeException

from common.errors import DeadlineExceeded
from services.ingress.failures import REPLICA_LOST
from services.ingress.responses import pending
from services.stages.upstream import Pending


class _Response:
    def __init__(self, ref=None, error: BaseException | None = None, delay: float = 0.0) -> None:
        self.ref, self.error, self.delay = ref, error, delay

    async def _to_object_ref(self):
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.ref


def _far() -> float:
    return time.time() + 30


def test_a_serve_response_becomes_its_result_reference():
    got = asyncio.run(pending(_Response(ref="ref-1"), _far(), "prefill"))
    assert got == Pending("ref-1", "prefill")


def test_an_in_process_response_passes_as_it_is():
    local = object()  # (no _to_object_ref: the monolith's LocalResponse)
    assert asyncio.run(pending(local, _far(), "prefill")) is local


def test_an_upstream_replica_lost_while_serve_routed_the_call_is_a_replica_loss():
    """Serve raises its own error, the actor death as its cause, when the prefill's upstream (encode) replica died:
    it must come out as the loss, which the chain re-issues, not as a 503 from an unknown error."""
    crash = RayServeException("an upstream replica crashed")
    crash.__cause__ = ActorDiedError()
    with pytest.raises(REPLICA_LOST):
        asyncio.run(pending(_Response(error=crash), _far(), "prefill"))
    other = RayServeException("something else")
    with pytest.raises(RayServeException):
        asyncio.run(pending(_Response(error=other), _far(), "prefill"))


def test_a_call_never_given_a_replica_ends_at_the_deadline():
    with pytest.raises(DeadlineExceeded, match="prefill stage was queued"):
        asyncio.run(pending(_Response(ref="r", delay=5), time.time() + 0.05, "prefill"))
