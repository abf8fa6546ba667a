"""Cache-affinity request router for the encode and prefill deployments (Ray Serve's custom request router API).

Serve builds one router per deployment handle, in the process that holds the handle — for the stages the ingress
calls, inside each ingress replica — with the ``request_router_kwargs`` of the deployment's
``request_router_config`` (:func:`services.app._options` sets it when ``routing.affinity`` is on). For every call
Serve resolves the arguments (a chained ``DeploymentResponse`` becomes an ``ObjectRef``), then asks
:meth:`AffinityRouter.choose_replicas` for replicas, best first, one per rank: Serve sends the call to the first that
accepts it (a replica whose queue is full refuses; the next rank is tried, then Serve backs off and asks again).

The key is the call's :class:`~common.protocol.handoff.RequestContext` ``route`` field — ``media`` for encode,
``prefix`` for prefill (``key=`` in the router kwargs; a group led by encode that holds prefill falls back to the
prefix for a request without media, ``fallback=``) — made by the ingress (:mod:`common.sched.affinity` says how
and why not from the payload). The choice itself is :class:`common.sched.affinity.AffinityTable`'s; this class only
feeds it Serve's events: which replica accepted a call (``on_request_routed``: Serve calls it for every accepted call
under its strict max-ongoing-requests protocol, the default for handles outside Ray Client — where the ingress runs;
a replica that refuses a full queue is never recorded, and the call is routed again), when that call completed
(``on_request_completed``, matched by request *and* replica, so a late completion of a refused attempt cannot free
another replica's count) and which replicas died; every replica set it is given is reported to
:mod:`services.routers.replica_sets` (how the ingress sees a replica leave). Each decision is counted in
``prism_route_affinity_total{stage, outcome}`` and kept for the request's trace (:mod:`services.routers.route_log`).

Serve pickles this module *by value* into the processes that hold a handle: it keeps no module state of its own (no
module-level locks or records — those live in modules pickled by reference), only the class.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from common.protocol.handoff import RequestContext
from common.sched.affinity import AffinityTable, Outcome
from services.platform.metrics import Metrics
from services.routers import route_log
from services.routers.replica_sets import ReportsReplicas

PENDING_KEPT = 4096
"""Routing decisions kept for calls Serve has not assigned yet (one cancelled before that never is)."""


@dataclass
class _Pending:
    key: str | None
    attempt_key: str | None
    first: str | None
    outcome: Outcome


def request_context(pending: PendingRequest | None) -> RequestContext | None:
    if pending is None:
        return None
    for arg in [*pending.args, *pending.kwargs.values()]:
        if isinstance(arg, RequestContext):
            return arg
    return None


class AffinityRouter(ReportsReplicas, RequestRouter):
    """Routes each call by its affinity key; see the module docstring."""

    def initialize_state(
        self,
        stage: str = "encode",
        key: str = "media",
        load_factor: float = 1.25,
        fallback: str | None = None,
        **_: Any,
    ):
        for name in (key, fallback or key):
            if name not in ("media", "prefix"):
                raise ValueError(f"AffinityRouter keys must be 'media' or 'prefix', not {name!r}")
        self._stage, self._key, self._fallback = stage, key, fallback
        self._table = AffinityTable(load_factor=load_factor)
        # internal request id → the decision, until Serve assigns a replica (a call cancelled before that never is:
        # the oldest are dropped past a bound)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._routed: set[tuple[str, str]] = set()  # (internal request id, replica) accepted and not yet completed
        self._lock = threading.Lock()  # (completion callbacks may come from another thread than routing)
        self._metrics: Any = None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ctx = request_context(pending_request)
        route = ctx.route if ctx is not None else None
        key = getattr(route, self._key, None) if route is not None else None
        if key is None and self._fallback is not None and route is not None:  # (a text request in an EPD group)
            key = getattr(route, self._fallback, None)
        with self._lock:
            order, outcome = self._table.choose(key, list(by_id))
            if pending_request is not None:
                decision = _Pending(key, ctx.key if ctx is not None else None, order[0] if order else None, outcome)
                self._pending[pending_request.metadata.internal_request_id] = decision  # (a later round's replaces it)
                while len(self._pending) > PENDING_KEPT:
                    self._pending.popitem(last=False)
        if pending_request is not None:
            # Every replica is ranked here, so a round that found them all full should back off before the next.
            pending_request.routing_context.should_backoff = True
        return [[by_id[r]] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """A replica accepted the call: it is in flight there, and a new key is placed there."""
        iid, rid = pending_request.metadata.internal_request_id, replica_id.unique_id
        with self._lock:
            decision = self._pending.pop(iid, None)
            if decision is None:
                return
            self._table.routed(decision.key, rid, place=decision.outcome in ("new", "moved"))
            self._routed.add((iid, rid))
        outcome: Outcome = decision.outcome if rid == decision.first else "spilled"
        self._count(outcome)
        if decision.attempt_key is not None:
            route_log.keep(self._stage, decision.attempt_key, {"outcome": outcome, "replica": rid})

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        with self._lock:
            if (internal_request_id, rid) in self._routed:
                self._routed.discard((internal_request_id, rid))
                self._table.completed(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._table.forget(replica_id.unique_id)

    def _count(self, outcome: str) -> None:
        if self._metrics is None:
            self._metrics = Metrics("ingress")
        self._metrics.inc("prism_route_affinity_total", stage=self._stage, outcome=outcome)
