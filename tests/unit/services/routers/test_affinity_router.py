"""The Serve request router of ours (services.routers.affinity.AffinityRouter), driven in-process through the hooks Ray
Serve 2.60 calls: choose_replicas, on_request_routed (a replica accepted the call), on_request_completed."""

from __future__ import annotations

import asyncio
import time

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from common.protocol.handoff import RequestContext, RouteKeys
from services.routers import route_log
from services.routers.affinity import AffinityRouter

DEPLOYMENT = DeploymentID(name="Encode", app_name="test")


class _Replica:
    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)


class _Counts:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def inc(self, name: str, **tags: str) -> None:
        self.seen.append({"name": name, **tags})


def _router() -> tuple[AffinityRouter, _Counts]:
    router = AffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(stage="encode", key="media")
    counts = _Counts()
    router._metrics = counts
    return router, counts


def _call(rid: str, media: str | None) -> tuple[PendingRequest, RequestContext]:
    ctx = RequestContext(rid, "t", time.time() + 30, time.time(), route=RouteKeys(media=media))
    meta = RequestMetadata(request_id=rid, internal_request_id=f"internal-{rid}")
    return PendingRequest(args=[object(), ctx], kwargs={}, metadata=meta), ctx


async def _choose(router, replicas, pending) -> list[str]:
    ranks = await router.choose_replicas(replicas, pending)
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_a_key_is_placed_where_accepted_and_its_repeats_follow_it():
    asyncio.run(_test_a_key_is_placed_where_accepted_and_its_repeats_follow_it())


async def _test_a_key_is_placed_where_accepted_and_its_repeats_follow_it():
    router, counts = _router()
    replicas = [_Replica("aaa"), _Replica("bbb")]
    pending, ctx = _call("r1", "image-1")
    order = await _choose(router, replicas, pending)
    assert sorted(order) == ["aaa", "bbb"] and pending.routing_context.should_backoff
    router.on_request_routed(pending, ReplicaID(order[0], DEPLOYMENT), None)
    assert route_log.take("encode", ctx.key) == {"outcome": "new", "replica": order[0]}
    router.on_request_completed(ReplicaID(order[0], DEPLOYMENT), pending.metadata.internal_request_id)
    again, ctx2 = _call("r2", "image-1")
    assert (await _choose(router, replicas, again))[0] == order[0]
    router.on_request_routed(again, ReplicaID(order[0], DEPLOYMENT), None)
    assert route_log.take("encode", ctx2.key) == {"outcome": "owner", "replica": order[0]}
    assert [c["outcome"] for c in counts.seen] == ["new", "owner"]
    assert all(c["name"] == "prism_route_affinity_total" and c["stage"] == "encode" for c in counts.seen)


def test_a_refused_attempt_never_counts_and_its_late_completion_frees_nothing_else():
    asyncio.run(_test_a_refused_attempt_never_counts_and_its_late_completion_frees_nothing_else())


async def _test_a_refused_attempt_never_counts_and_its_late_completion_frees_nothing_else():
    """Serve's rejection protocol: the chosen replica refuses (full queue), the call is routed again and accepted
    elsewhere; the refused attempt's completion arrives later and must not free the other replica's count."""
    router, _ = _router()
    replicas = [_Replica("aaa"), _Replica("bbb")]
    pending, ctx = _call("r1", "image-2")
    first, other = await _choose(router, replicas, pending)
    retry = await _choose(router, replicas, pending)  # refused at `first`: no on_request_routed; Serve asks again
    router.on_request_routed(pending, ReplicaID(other, DEPLOYMENT), None)
    assert retry[0] == first and router._table.in_flight[other] == 1 and router._table.in_flight[first] == 0
    assert route_log.take("encode", ctx.key) == {"outcome": "spilled", "replica": other}
    iid = pending.metadata.internal_request_id
    router.on_request_completed(ReplicaID(first, DEPLOYMENT), iid)  # the refused attempt, late
    assert router._table.in_flight[other] == 1
    router.on_request_completed(ReplicaID(other, DEPLOYMENT), iid)
    assert router._table.in_flight[other] == 0
    assert router._table.owner("image-2") == other, "placed where it was accepted"


def test_no_key_goes_to_the_least_busy_and_a_dead_replica_is_forgotten():
    asyncio.run(_test_no_key_goes_to_the_least_busy_and_a_dead_replica_is_forgotten())


async def _test_no_key_goes_to_the_least_busy_and_a_dead_replica_is_forgotten():
    router, _ = _router()
    replicas = [_Replica("aaa"), _Replica("bbb")]
    busy, _ = _call("r1", "image-3")
    owner = (await _choose(router, replicas, busy))[0]
    router.on_request_routed(busy, ReplicaID(owner, DEPLOYMENT), None)
    text, ctx = _call("r2", None)
    order = await _choose(router, replicas, text)
    assert order[0] != owner
    router.on_request_routed(text, ReplicaID(order[0], DEPLOYMENT), None)
    assert route_log.take("encode", ctx.key)["outcome"] == "none"
    router.on_replica_actor_died(ReplicaID(owner, DEPLOYMENT))
    assert router._table.in_flight[owner] == 0


def test_a_group_led_by_encode_routes_a_text_request_by_its_prefix():
    asyncio.run(_test_a_group_led_by_encode_routes_a_text_request_by_its_prefix())


async def _test_a_group_led_by_encode_routes_a_text_request_by_its_prefix():
    """An ``EPD`` group's router is keyed by the media, with the prompt prefix as fallback: a text request's repeats
    follow their prefix to the replica whose prefix cache holds it (without the fallback: no key, by load)."""
    router = AffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(stage="encode", key="media", fallback="prefix")
    router._metrics = _Counts()
    replicas = [_Replica("aaa"), _Replica("bbb")]

    def text(rid: str) -> tuple[PendingRequest, RequestContext]:
        ctx = RequestContext(rid, "t", time.time() + 30, time.time(), route=RouteKeys(prefix="prompt-1"))
        meta = RequestMetadata(request_id=rid, internal_request_id=f"internal-{rid}")
        return PendingRequest(args=[object(), ctx], kwargs={}, metadata=meta), ctx

    first, ctx = text("t1")
    owner = (await _choose(router, replicas, first))[0]
    router.on_request_routed(first, ReplicaID(owner, DEPLOYMENT), None)
    assert route_log.take("encode", ctx.key) == {"outcome": "new", "replica": owner}
    router.on_request_completed(ReplicaID(owner, DEPLOYMENT), first.metadata.internal_request_id)
    again, ctx2 = text("t2")
    assert (await _choose(router, replicas, again))[0] == owner
    router.on_request_routed(again, ReplicaID(owner, DEPLOYMENT), None)
    assert route_log.take("encode", ctx2.key) == {"outcome": "owner", "replica": owner}
