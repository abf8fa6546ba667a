"""In-process stand-ins for Serve deployment handles, so the ingress and the stage classes run in one process: a model
served in its ingress replica (``deployments.in_ingress``), and the monolith baseline
(:mod:`loadtest.servers.monolith`), both built by :func:`local_pipeline`.

``LocalHandle(obj).method.remote(*args)`` starts ``obj.method(*args)`` as an asyncio task after awaiting any
argument that is itself a pending call (Serve resolves a ``DeploymentResponse`` passed to another call the same way);
``.options(stream=True).remote(...)`` gives an async iterator with ``cancel()`` over a streaming method. Cancelling a
stream also cancels the upstream calls it was waiting on, as Serve propagates cancellation, and a read in progress
ends with Serve's ``RequestCancelledError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ray.serve.exceptions import RequestCancelledError


class LocalResponse:
    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.task = asyncio.get_running_loop().create_task(_call(method, args))

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class LocalStream:
    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.method, self.args = method, args
        self._gen: Any = None
        self._reading: asyncio.Task | None = None
        self._cancelled = False

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        if self._cancelled:
            raise RequestCancelledError("the stream was cancelled")
        self._reading = asyncio.current_task()
        try:
            if self._gen is None:
                args = await _resolve(self.args)
                if self._cancelled:  # (cancelled as its arguments arrived: the method never starts)
                    raise RequestCancelledError("the stream was cancelled")
                self._gen = self.method(*args)
            return await self._gen.__anext__()
        except asyncio.CancelledError:
            if not self._cancelled or self._reading is None:
                raise
            self._reading.uncancel()  # (cancelled by cancel() below, not by its caller: Serve's error instead)
            raise RequestCancelledError("the stream was cancelled") from None
        finally:
            self._reading = None

    def cancel(self) -> None:
        """Like Serve's: a read in progress ends with ``RequestCancelledError`` (the generator closed where it
        waited), and so does every later one."""
        self._cancelled = True
        for arg in self.args:
            if isinstance(arg, LocalResponse):
                arg.cancel()
        if self._reading is not None:
            self._reading.cancel()
        elif self._gen is not None:
            asyncio.get_running_loop().create_task(self._gen.aclose())


class _Method:
    def __init__(self, method: Callable[..., Any], stream: bool = False) -> None:
        self.method, self.stream = method, stream

    def options(self, stream: bool = False) -> _Method:
        return _Method(self.method, stream)

    def remote(self, *args: Any) -> LocalResponse | LocalStream:
        return LocalStream(self.method, args) if self.stream else LocalResponse(self.method, args)


class LocalHandle:
    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


async def _resolve(args: tuple[Any, ...]) -> list[Any]:
    return [await a if isinstance(a, LocalResponse) else a for a in args]


async def _call(method: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return await method(*(await _resolve(args)))


def local_pipeline(sub: Any, transport: Any = None) -> list[LocalHandle | None]:
    """A model's pipeline as the chain takes it (:class:`services.ingress.chain.Chain`), every stage object built in
    this process behind a local handle: its media stage where the topology keeps it apart (else ``None``), then one
    object per group of its topology (a group as one :class:`GroupDeployment`, as in its replica). ``transport``
    overrides the config's KV transport for the hops between groups (tests pass the fake backend). The ingress builds
    it for a model served in its replica (``deployments.in_ingress``, topology ``MEPD``: ``[None, the group]``); the
    monolith baseline for every model, in any topology.

    Every stage shares the one process, as the stages of a grouped replica share theirs: built ``grouped``, the media
    and encode stages nice only their own threads. Built alone, each renices its whole process (right for a replica of
    its own), which would put the ingress, the short prefills and decode at niceness 19 too."""
    from common.config.topology import groups, media_apart
    from services.stages.decode import DecodeDeployment
    from services.stages.encode import EncodeDeployment
    from services.stages.group import GroupDeployment
    from services.stages.media import MediaDeployment
    from services.stages.prefill import PrefillDeployment

    raw = sub.model_dump(mode="json")
    single = {
        "encode": lambda: EncodeDeployment(raw, grouped=True),
        "prefill": lambda: PrefillDeployment(raw, transport),
        "decode": lambda: DecodeDeployment(raw, transport),
    }
    topology = sub.deployments.topology
    objs = [single[g[0]]() if len(g) == 1 else GroupDeployment(raw, g, transport) for g in groups(topology)]
    media = LocalHandle(MediaDeployment(raw, grouped=True)) if media_apart(topology) else None
    return [media, *(LocalHandle(obj) for obj in objs)]
