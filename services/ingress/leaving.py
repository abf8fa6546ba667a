"""Moving the decode streams of a replica that is leaving: autoscaler scale-down, rolling update, node drain.

Serve gives a replica it stops no signal while its calls run: it takes it out of every router's set, waits up to the
deployment's ``graceful_shutdown_timeout_s`` for its ongoing calls, then kills it. The ingress's routers report those
sets (:mod:`services.routers.replica_sets`); this watch listens.

Lifecycle: :class:`~services.ingress.call_stream.CallStream` registers each call it reads (:meth:`LeavingWatch.watch`)
until the call closes (:meth:`LeavingWatch.forget`); a call knows the decode replica its stream comes from (the
stream's start says so). When a replica leaves a deployment's set while a watched call streams from it — or a call's
stream starts on a replica that already left — a *drain* of that replica starts on the ingress's loop: the call is
given ``server.drain_grace_s`` to finish where it is (short streams do), then every one still running that can move
(see ``movable``) is moved: :meth:`Call.move` marks it and cancels its stream — the leaving replica frees the
sequence's KV at once — and ``CallStream.tokens`` takes the cancellation for what it is
(:class:`~services.ingress.failures.ReplicaLeft`) and migrates the call as it would a lost replica's: the chain issued
again on a live replica (a refusal for a full queue waited out until the deadline), the tokens sent replayed, nothing
seen by the client. The deployment's ``graceful_shutdown_timeout_s`` leaves time for that (:mod:`services.app`).

Where the deployment has no live replica to move to yet (an update that stops a one-replica stage before starting
its replacement), the calls stay where they run and the drain looks again every :data:`POLL_S`, until a replica is
there, the calls ended, or the replica died (then they migrate as from any lost replica). A replica that comes back
into the set (an in-place update can take it out for a moment) ends its drain with nothing moved.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from services.routers import replica_sets

log = logging.getLogger("prism.ingress")

POLL_S = 0.5
"""How often a drain with nowhere to move its streams yet looks again."""


class Call(Protocol):
    """What the watch needs of a :class:`services.ingress.call_stream.Call`."""

    decode_replica: str | None
    leaving: str | None
    watch: Any

    def move(self) -> None: ...


class LeavingWatch:
    def __init__(
        self,
        grace_s: float,
        movable: Callable[[Call], bool],
        deployment: str | None = None,
        count_left: Callable[[str], None] = lambda deployment: None,
        poll_s: float = POLL_S,
    ) -> None:
        """``movable``: whether a call may be moved now (migrations left, one choice, deadline ahead);
        ``deployment``: the one whose replicas stream the calls (``app/name``; ``None``: any);
        ``count_left(deployment)``: counts a replica that left it (``prism_replicas_left_total``)."""
        self.grace_s, self.poll_s, self._movable, self._count_left = grace_s, poll_s, movable, count_left
        self.deployment = deployment
        self._calls: weakref.WeakValueDictionary[int, Call] = weakref.WeakValueDictionary()
        self._drains: dict[str, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.moved = 0
        """Streams moved off leaving replicas (their outcomes are counted as migrations)."""
        replica_sets.listen(self._heard)

    def watch(self, call: Call) -> None:
        """Watch ``call`` (on the ingress's loop) until :meth:`forget` — :meth:`Call.close` calls it — or until
        nothing else holds it."""
        self._loop = asyncio.get_running_loop()
        self._calls[id(call)] = call
        call.watch = self
        deployment, replica = self.deployment, call.decode_replica
        if deployment is not None and replica is not None and replica_sets.gone(deployment, replica):
            self._start(deployment, frozenset({replica}), count=False)  # (its stream started after the replica left)

    def forget(self, call: Call) -> None:
        self._calls.pop(id(call), None)

    def _heard(self, deployment: str, left: frozenset[str]) -> None:
        """Replicas left ``deployment`` (on the router's thread): drain them on the ingress's loop."""
        loop = self._loop
        if self.deployment not in (None, deployment):
            return
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._start, deployment, left)
            except RuntimeError:  # the loop closed: nothing left to move
                pass

    def _start(self, deployment: str, left: frozenset[str], count: bool = True) -> None:
        for replica in left:
            if count:
                self._count_left(deployment.rpartition("/")[2])
            if replica not in self._drains and self._on(replica):
                self._drains[replica] = asyncio.get_running_loop().create_task(self._drain(deployment, replica))

    def _on(self, replica: str) -> list[Call]:
        return [c for c in list(self._calls.values()) if c.decode_replica == replica and c.leaving is None]

    async def _drain(self, deployment: str, replica: str) -> None:
        try:
            await asyncio.sleep(self.grace_s)
            while True:
                present = replica_sets.present(deployment)
                calls = [c for c in self._on(replica) if self._movable(c)]
                if replica in present or not calls:
                    return
                if present:  # somewhere to go
                    log.info("moving %d streams off decode replica %s, which left %s", len(calls), replica, deployment)
                    for call in calls:
                        call.move()
                    self.moved += len(calls)
                    return
                await asyncio.sleep(self.poll_s)
        finally:
            self._drains.pop(replica, None)
