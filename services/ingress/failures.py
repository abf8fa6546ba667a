"""How a request's failures reach the ingress, and the typed error each one becomes.

Three kinds of exception arrive from a stage chain besides Prism's own typed errors: a **replica lost** under the
request (:data:`REPLICA_LOST`; retried before the first token, migrated after it, else 503), the **client gone**
(:data:`CANCELLED`: recorded with status 499, nobody to answer) and anything else (a 500 ``internal_error``, logged
with its traceback — frames and exception type, never the message, which may quote the request).
"""

from __future__ import annotations

import asyncio
import logging
import traceback

from ray.exceptions import ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException, RequestCancelledError
from starlette.requests import ClientDisconnect

from common.errors import HandoffLost, Overloaded, PrismError, StageUnavailable

log = logging.getLogger("prism.ingress")


class ReplicaLeft(Exception):
    """The decode replica of a running stream left its deployment (scale-down, rolling update, node drain) and the
    ingress took the stream off it (:mod:`services.ingress.leaving`): it moves like a lost replica's."""


REPLICA_LOST = (RayActorError, ActorUnavailableError, DeploymentUnavailableError, HandoffLost, ReplicaLeft)
"""Failures that say a stage replica went away under the request (retried before the first token, else 503) — a
hand-off whose sender died before it was read among them."""


def replica_lost(exc: BaseException) -> BaseException | None:
    """The replica loss behind ``exc``, if that is what it is: ``exc`` itself, or the actor death Serve wraps in a
    ``RayServeException`` when a call of a chain fails because an *upstream* call's replica died (the decode stream
    reports a prefill or encode replica lost that way)."""
    if isinstance(exc, REPLICA_LOST):
        return exc
    if isinstance(exc, RayServeException) and isinstance(exc.__cause__, REPLICA_LOST):
        return exc.__cause__
    return None


CANCELLED = (asyncio.CancelledError, GeneratorExit, TaskCancelledError, RequestCancelledError, ClientDisconnect)
"""How the client going away reaches the ingress: its own task cancelled, Serve cancelling a call under it (the
proxy saw the disconnect), or the body read finding the client gone."""

CANCELLED_STATUS = 499
"""Status recorded when the client went away (nginx's convention: no response was sent)."""


def typed_error(exc: BaseException, retry_after_s: float) -> PrismError:
    """The typed error a failure maps to: Serve's backpressure is a 429, a lost replica a 503, anything unexpected a
    500 ``internal_error``."""
    if isinstance(exc, PrismError) and replica_lost(exc) is None:
        return exc
    if isinstance(exc, BackPressureError):
        return Overloaded("a stage is at capacity; retry later", retry_after_s=retry_after_s)
    if replica_lost(exc) is not None:
        return StageUnavailable("a stage replica failed while serving this request; retry", retry_after_s=retry_after_s)
    return PrismError("internal error; see the server logs")


def log_failure(request_id: str, status: int, code: str, exc: BaseException) -> None:
    """Log a 5xx with the traceback's frames and the exception's type — not its message, which may quote the
    client's input (a validation error repeats the value it refused)."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    log.error("request %s failed: %d %s (%s)\n%s", request_id, status, code, type(exc).__name__, frames.rstrip())
