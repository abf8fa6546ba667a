"""The replica sets the routers report: a replica leaves a deployment only once no router of it in the process still
routes to it, listeners hear of it (and only of it) then, and a listener goes with its object."""

from __future__ import annotations

import gc
import weakref

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


def test_a_listener_is_held_weakly_and_cannot_fail_the_update():
    ear = _Ear()
    replica_sets.listen(ear.hear)
    gone = weakref.ref(ear)
    del ear
    gc.collect()
    assert gone() is None, "the registry does not keep its listeners alive"

    class _Failing:
        def hear(self, deployment, left):
            raise RuntimeError("the loop closed")

    failing, after = _Failing(), _Ear()
    replica_sets.listen(failing.hear)
    replica_sets.listen(after.hear)
    replica_sets.update(1, "app-t2/Decode", ["a"])
    replica_sets.update(1, "app-t2/Decode", [])  # (Serve's router called this: it must not raise)
    assert after.heard == [("app-t2/Decode", frozenset({"a"}))]


def test_a_router_gone_takes_its_set_with_it():
    class _Base:
        def update_replicas(self, replicas):
            pass

    class _Router(ReportsReplicas, _Base):
        _deployment_id = type("Dep", (), {"app_name": "app-t4", "name": "Decode"})()

    replica = type("R", (), {"replica_id": type("Id", (), {"unique_id": "r9"})()})()
    router = _Router()
    router.update_replicas([replica])
    assert replica_sets.present("app-t4/Decode") == {"r9"} and not replica_sets.gone("app-t4/Decode", "r9")
    assert replica_sets.gone("app-t4/Decode", "r8") and not replica_sets.gone("app-t5/Decode", "r9"), (
        "unknown: not gone"
    )
    del router
    gc.collect()
    assert replica_sets.present("app-t4/Decode") == frozenset() and not replica_sets.gone("app-t4/Decode", "r9")


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
