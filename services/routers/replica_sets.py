"""The replicas each deployment's routers route to, as this process's routers see them: how the ingress learns that
a replica is leaving.

Serve stops routing to a replica the moment its controller decides to stop it (autoscaler scale-down, a rolling
update, a node drain): the replica leaves the running set that every router gets by long poll
(``RequestRouter.update_replicas``); then Serve waits up to the deployment's ``graceful_shutdown_timeout_s`` for the
calls it still runs, and kills it. The replica itself is told nothing while its streams run. Prism's routers
(:mod:`services.routers.affinity`, :mod:`services.routers.pinned`) mix in :class:`ReportsReplicas`, which reports
every set they get here; :class:`services.ingress.leaving.LeavingWatch` listens and moves the decode streams of a
replica that left.

Several routers may serve one deployment in a process (one per handle): a replica counts as present while any of
them still has it, so a router whose long poll lags a moment behind another's never makes a replica look as if it
came back. Like :mod:`services.routers.route_log`, this module is pickled by reference — its state is the process's,
shared by the routers (on Serve's router loop) and the ingress (on its own loop); listeners are called on the
router's thread and must hand over to their own loop.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("prism.ingress")

Listener = Callable[[str, frozenset[str]], None]
"""Called with a deployment and the replicas that just left it."""

_lock = threading.Lock()
_sets: dict[str, dict[int, frozenset[str]]] = {}
"""Deployment → router (its ``id``) → the replica ids it routes to."""
_listeners: list[weakref.WeakMethod] = []


def _present(deployment: str) -> frozenset[str]:
    return frozenset().union(*_sets.get(deployment, {}).values())


def update(router: int, deployment: str, replicas: Iterable[str]) -> None:
    """``router`` (of ``deployment``) now routes to ``replicas``; listeners hear of the replicas that left."""
    with _lock:
        before = _present(deployment)
        _sets.setdefault(deployment, {})[router] = frozenset(replicas)
        left = before - _present(deployment)
        listeners = [m() for m in _listeners]
    if left:
        for listener in listeners:
            if listener is not None:
                try:
                    listener(deployment, left)
                except Exception:  # (never into Serve's replica update, which would skip its own work)
                    log.exception("a listener failed on replicas leaving %s", deployment)


def forget(router: int, deployment: str) -> None:
    """``router`` is gone: its set no longer keeps replicas present."""
    with _lock:
        _sets.get(deployment, {}).pop(router, None)


def gone(deployment: str, replica: str) -> bool:
    """Whether ``replica`` left ``deployment``: some router of it in this process reported a set, and none has it."""
    with _lock:
        return bool(_sets.get(deployment)) and replica not in _present(deployment)


def present(deployment: str) -> frozenset[str]:
    """The replicas some router of ``deployment`` in this process routes to."""
    with _lock:
        return _present(deployment)


def listen(method: Listener) -> None:
    """Call the bound ``method`` when replicas leave a deployment (held weakly: it goes with its object)."""
    with _lock:
        _listeners[:] = [m for m in _listeners if m() is not None]
        _listeners.append(weakref.WeakMethod(method))  # type: ignore[arg-type]


def key(app: str, deployment: str) -> str:
    """The name a deployment is reported under (``app/deployment``)."""
    return f"{app}/{deployment}"


def deployment_key(router: Any) -> str:
    """The name a router's deployment is reported under (:func:`key`)."""
    dep = getattr(router, "_deployment_id", None)
    return key(getattr(dep, "app_name", ""), getattr(dep, "name", ""))


class ReportsReplicas:
    """Mixed into a Serve request router: reports every replica set it is given (see the module docstring)."""

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        deployment = deployment_key(self)
        if not getattr(self, "_reports", False):  # (once: a router gone takes its set with it)
            self._reports = True
            weakref.finalize(self, forget, id(self), deployment)
        update(id(self), deployment, [r.replica_id.unique_id for r in replicas])
