"""A stage call sent before its upstream has finished: the upstream's result as a reference the stage awaits itself.

Why. A Serve call chained on another (``decode.generate.remote(prefill_response, …)``) is sent only once the
upstream's result exists: the ingress's router waits for it, then routes the call and sends it, and the replica
starts it — all on the request's time, after the upstream finished. Measured on a 2-core AMD EPYC (a
two-deployment Serve app, a 0.5 MB result, nothing else running): upstream done → downstream started 7.0–7.2 ms
chained, 3.7–4.1 ms when the downstream call was already waiting on the result's reference. Prism's traces show this
hop as ``decode.transfer`` (``loadtest.bench_hops``).

Where the downstream replica is known before the upstream finishes — decode, whose KV reservation named it — the
ingress sends the call at once with :class:`Pending`: the upstream's result reference (``ObjectRef``), nested in this
wrapper so that neither Serve nor Ray resolves it on the way. The stage then awaits it (:func:`arrived`): when the
upstream finishes, its owner (the ingress's core worker; no Python in between) tells the waiting replica, which reads
the result where it lies (the object store's shared memory on this node).

Lifecycle: the waiting call holds the request slot its reservation committed for it (the decode replica counts one per
reservation), and nothing else: it registers its stream only once the upstream arrived. Cancelling the chain cancels
it while it waits, like any call.

Failures come back as the upstream's own: a stage's typed error (a 4xx decided in prefill) is raised here as that
error; a lost upstream replica as :class:`~common.errors.HandoffLost` (the ingress re-issues the chain, as for any
replica lost before the first token) — never as the actor death itself, which Serve's router would take for the death
of *this* replica and drop it from its set. (Serve logs such a failure on this replica too, as one of its requests
that failed: the price of the upstream's error travelling through it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError

from common.errors import HandoffLost

LOST = (RayActorError, ActorUnavailableError, ObjectLostError)
"""What awaiting an upstream's result raises when the upstream's replica (or its result) went away."""


@dataclass(frozen=True)
class Pending:
    """The result of an upstream call that may not have finished yet."""

    ref: Any
    """Its ``ray.ObjectRef`` (anything awaitable for the result, in tests)."""
    stage: str
    """The upstream stage, for the error that says it was lost."""


async def arrived(value: Any) -> Any:
    """``value`` itself, or the result behind a :class:`Pending` once its upstream finished (see the module docstring
    for how failures come back)."""
    if not isinstance(value, Pending):
        return value
    try:
        return await value.ref
    except (*LOST, RayTaskError) as exc:
        cause = exc.cause if isinstance(exc, RayTaskError) else exc  # (a loss inside the upstream's call, or here)
        if isinstance(cause, LOST):
            raise HandoffLost(f"the {value.stage} replica was lost before its hand-off was read") from exc
        if isinstance(cause, Exception):
            raise cause from None  # (the upstream's own error, as it raised it)
        raise
