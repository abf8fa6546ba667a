"""The replica sets the routers report: a replica leaves a deployment only once no router of it in the process still
routes to it, listeners hear of it (and only of it) then, and a listener goes with its object."""

from __future__ import annotations

import gc

from ray.serve.request_router import RequestRouter

from services.routers import replica_sets
from services.routers.affinity import AffinityRouter
from services.routers.pinned import PinnedRouter
from services.routers.replica_sets import ReportsReplicas


class _Ear:
    def __init__(self) -> None:
        self.heard: list[tuple[str, frozenset[str]]] = []

    def hear(self, deployment: str, left: frozenset[str]) -> None:
        self.heard.append((deployment, left))


def test_a_replica_leaves_once_no_router_of_its_deployment_has_it():
    ear = _Ear()
    replica_sets.listen(ear.hear)
    dep = "app-t1/Decode"
    replica_sets.update(1, dep, ["a", "b"])
    replica_sets.update(2, dep, ["a", "b"])  # a second handle's router of the same deployment
    replica_sets.update(1, dep, ["a"])
    assert ear.heard == [] and replica_sets.present(dep) == {"a", "b"}, "the other router still routes to b"
    replica_sets.update(2, dep, ["a", "c"])
    assert ear.heard == [(dep, frozenset({"b"}))]
    assert replica_sets.present(dep) == {"a", "c"}
    replica_sets.update(3, "app-t1/Other", ["x"])
    replica_sets.update(3, "app-t1/Other", [])
    assert ear.heard[-1] == ("app-t1/Other", frozenset({"x"})) and replica_sets.present("app-t1/Other") == frozenset()


def test_a_listener_is_held_weakly():
    ear = _Ear()
    replica_sets.listen(ear.hear)
    del ear
    gc.collect()
    replica_sets.update(1, "app-t2/Decode", ["a"])
    replica_sets.update(1, "app-t2/Decode", [])  # (a dead listener is skipped, not called)


def test_prism_routers_report_their_sets():
    assert issubclass(PinnedRouter, ReportsReplicas) and issubclass(AffinityRouter, ReportsReplicas)
    assert PinnedRouter.__mro__.index(ReportsReplicas) < PinnedRouter.__mro__.index(RequestRouter)

    class _Replica:
        def __init__(self, rid: str) -> None:
            self.replica_id = type("Id", (), {"unique_id": rid})()

    class _Base:
        def update_replicas(self, replicas):
            self.got = replicas

    class _Router(ReportsReplicas, _Base):
        _deployment_id = type("Dep", (), {"app_name": "app-t3", "name": "Decode"})()

    router = _Router()
    router.update_replicas([_Replica("r1"), _Replica("r2")])
    assert len(router.got) == 2 and replica_sets.present("app-t3/Decode") == {"r1", "r2"}
