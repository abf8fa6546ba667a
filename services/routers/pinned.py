"""Request router of the decode deployment: a call goes to the replica that holds its KV reservation.

The ingress reserves a request's KV blocks on one decode replica before prefill computes
(:meth:`services.stages.decode.DecodeDeployment.reserve`) and names that replica in the context it passes to
``generate`` (``RequestContext.decode_replica``). Serve builds this router in the ingress (one per decode handle) and
asks it for every decode call: a call whose context names a replica among the candidates goes there and nowhere else —
if that replica's queue is full, Serve backs off (``should_backoff``) and asks again, so the call waits for it rather
than leasing a second time elsewhere (the decode stage keeps a slot free for every reservation's ``generate``:
:meth:`services.stages.decode.DecodeDeployment.reserve`). A call with no named replica (``reserve`` itself), or one
whose replica is gone (died, scaled down: the replica that takes it leases afresh on submit), is routed like Serve's
default: two candidates at random, and Serve takes the one with the shorter queue. A group that ends with decode
(``PD``, ``EPD``) without cache affinity gets this router too — its calls name no replica, so they are routed like
Serve's default — for what every Prism router does besides: report its replica set
(:mod:`services.routers.replica_sets`), so the ingress sees a decode replica leave.

Not FIFO: with Serve's ``FIFOMixin`` a replica found for one call is handed to the oldest call waiting in the router,
which would send a pinned call to another call's replica. Serve's base router matches each replica to the call it
was chosen for.

Like :mod:`services.routers.affinity`, Serve may pickle this module by value into the processes holding a handle: no
module state.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from services.routers.affinity import request_context
from services.routers.replica_sets import ReportsReplicas


class PinnedRouter(ReportsReplicas, RequestRouter):
    """Routes a decode call to its reserving replica; see the module docstring."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # a round whose replicas were all full backs off before the next
            pending_request.routing_context.should_backoff = True
        ctx = request_context(pending_request)
        pinned = ctx.decode_replica if ctx is not None else None
        if pinned is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == pinned:
                    return [[replica]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
