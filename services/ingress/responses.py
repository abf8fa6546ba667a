"""Operations on a chain's Serve responses that the ingress needs wherever it holds them: cancel them all, and read
the decode stream's next event under the deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any, NoReturn

from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentResponseGenerator

from common.errors import DeadlineExceeded, PrismError
from common.protocol.handoff import DecodeEvent
from services.ingress.failures import replica_lost
from services.stages.upstream import Pending


def cancel_chain(chain: list[Any]) -> None:
    """Cancel every stage response of a chain; never raises."""
    for response in reversed(chain):  # decode first: it frees KV at once
        try:
            response.cancel()
        except Exception:  # Serve's cancel() re-raises the error of a call that already failed: nothing to cancel
            pass


async def next_event(stream: DeploymentResponseGenerator, deadline: float) -> DecodeEvent:
    """The decode stream's next event before ``deadline`` (504 and the stream cancelled after it); a chain whose
    upstream replica died surfaces as the replica-lost error it is, not as Serve's wrapper of it."""
    left = deadline - time.time()
    if left <= 0:
        stream.cancel()
        raise DeadlineExceeded("deadline exceeded")
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout=left)
    except TimeoutError:
        stream.cancel()
        raise DeadlineExceeded("deadline exceeded while the request was in flight") from None
    except StopAsyncIteration:
        raise PrismError("decode stream ended unexpectedly") from None
    except RayServeException as exc:  # an upstream replica of the chain died: a replica loss like any other
        _raise_loss_behind(exc)


async def settled(response: Any, deadline: float, what: str = "the media stage") -> None:
    """Wait until a stage call has finished — its result (or its error) exists, wherever it lies — without fetching it
    here: a media stage's pixels stay where they are. 504 at the deadline. A Serve response is waited on through its
    object (``ObjectRef._ready``: no fetch, no deserialisation); an in-process one (the monolith's
    :mod:`services.ingress.local_handles`) through its task. A call that failed surfaces later, in the call that
    consumes its result."""
    try:
        if hasattr(response, "_to_object_ref"):
            ref = await asyncio.wait_for(response._to_object_ref(), timeout=_left(deadline))
            await asyncio.wait_for(ref._ready(), timeout=_left(deadline))
        else:
            done, _ = await asyncio.wait({response.task}, timeout=_left(deadline))
            if not done:
                raise TimeoutError
    except TimeoutError:
        raise DeadlineExceeded(f"deadline exceeded while {what} worked") from None


async def pending(response: Any, deadline: float, stage: str) -> Any:
    """A Serve call's result as a :class:`~services.stages.upstream.Pending` reference, for a downstream call sent
    before it finished, once Serve has given the call a replica (504 at the deadline if it never does; the replica
    loss behind Serve's error when the call's own upstream replica died first); an in-process response (the
    monolith's) as it is: it is awaited where it is passed."""
    if not hasattr(response, "_to_object_ref"):
        return response
    try:
        ref = await asyncio.wait_for(response._to_object_ref(), timeout=_left(deadline))
    except TimeoutError:
        raise DeadlineExceeded(f"deadline exceeded while the {stage} stage was queued") from None
    except RayServeException as exc:  # the call's own upstream replica died before Serve could route it
        _raise_loss_behind(exc)
    return Pending(ref, stage)


def _raise_loss_behind(exc: RayServeException) -> NoReturn:
    """Serve's error as the replica loss it wraps, if it wraps one (the chain re-issues that), else as it was."""
    lost = replica_lost(exc)
    if lost is None:
        raise exc
    raise lost from None


def _left(deadline: float) -> float:
    return max(deadline - time.time(), 0.001)
