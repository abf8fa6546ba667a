"""A request's stage chain, issued as numbered attempts from its :class:`~services.ingress.plan.AdmittedRequest`.

One :class:`Chain` per served model holds the model's media handle and one handle per group of its topology
(:mod:`common.config.topology`). For one admitted request,
:meth:`Chain.issuer` returns its :data:`Issue`: each call makes the next attempt (a fresh :class:`RequestContext`:
attempt number, the time it was sent, the migration's ``replay`` when there is one) and runs it, re-issued on a lost
replica with bounded, jittered backoff (:mod:`services.ingress.retry`) — never past the deadline. An attempt
(:meth:`Chain.attempt`):

```
media ──► (its items done) ──► encode ─────┐   (encode takes media's response: the pixels go replica to replica)
                           └─► reserve KV ─┴─► prefill ──► decode stream ──► StreamStart (prompt ids, every span)
```

(the default ``E/P/D``), so pixels, embeddings and KV go replica to replica (the object store, or NIXL) and never
through the ingress. A decode call whose replica the reservation named is sent as soon as Serve has given the prefill
call a replica, and waits there for the prefill's result (:mod:`services.stages.upstream`): the hop after the prefill
is then the result's notice and read, not the ingress's routing and sending of the call too.
In a grouped topology each group is one call (:mod:`services.stages.group`): ``E/PD`` is media, encode, then one
streaming call that reserves the KV in its own replica, prefills and decodes; ``EPD`` is media, then
that call with encode in it too; ``EP/D`` reserves here, then one call encodes and prefills for the decode stream.
Where media is grouped with encode, the request's media references go to that group's call: ``ME/P/D`` is one call
that fetches, processes and encodes, then the reservation here, prefill and decode; ``ME/PD`` is that call, then the
streaming one; ``MEPD`` is one streaming call that does it all (its replica reserves the KV once its media is done).
The decode KV is reserved (:mod:`services.ingress.kv_reserver`) before prefill computes — for a request with media once
the media stage has finished with its items (fetched, checked, decoded: the ingress waits on the call's result without
fetching it; a call that also encodes is waited for whole), while encode works; a slow or hostile download then holds
no decode blocks and no decode request slot (in ``MEPD`` it holds a slot of the group's replica, which has media's
slots on top of decode's: :meth:`common.config.deployments.ModelStages.group_stage`).
It waits for the stream's start, so every stage's error surfaces before a protocol commits to a status; an attempt that
fails cancels every response of its chain and gives back a reservation no stream claimed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle

from common.config import PrismConfig
from common.config.topology import Group, groups, hops, media_apart
from common.errors import HandoffError
from common.obs.request_trace import RequestTrace
from common.obs.trace import waited
from common.protocol.handoff import RequestContext, StreamStart
from services.ingress.failures import REPLICA_LOST
from services.ingress.kv_reserver import KVReserver
from services.ingress.plan import AdmittedRequest
from services.ingress.responses import cancel_chain, next_event, pending, settled
from services.ingress.retry import with_retries


@dataclass(frozen=True)
class Started:
    """An attempt whose decode stream has started."""

    responses: list[Any]
    """Every stage response of the attempt (media, encode, prefill, the decode stream last): cancelled together."""
    ctx: RequestContext
    """The attempt's context, naming the decode replica that holds its KV reservation."""
    first: StreamStart

    @property
    def stream(self) -> Any:
        return self.responses[-1]

    @property
    def decode_route(self) -> tuple[str, str] | None:
        """``(outcome, replica)`` of the attempt's KV reservation, for the trace's ``routing.decode``, as the stream's
        start tells it — whoever took it (the ingress's reserver, in the context the decode stage got; a group, in its
        own replica), the reservation is where the stream runs; ``None``: none taken (or outside Serve)."""
        outcome, replica = self.first.reservation, self.first.replica
        return (outcome, replica) if outcome != "none" and replica is not None else None


Issue = Callable[[tuple[int, ...]], Awaitable[Started]]
"""Issues a request's chain as its next attempt, replaying the given tokens (``()``: not a migration)."""


class Chain:
    def __init__(self, cfg: PrismConfig, media: DeploymentHandle | None, *deployments: DeploymentHandle) -> None:
        """``media``: the model's media deployment (``None`` where the topology groups it with encode);
        ``deployments``: one handle per group of the model's topology, in its order (``E/P/D``: encode, prefill,
        decode)."""
        self.cfg = cfg
        self.topology = cfg.deployments.topology
        if (media is None) == media_apart(self.topology):
            raise ValueError(f"topology {self.topology}: the media handle must be given exactly when media is apart")
        self.media = media
        self.handles = dict(zip(groups(self.topology), deployments, strict=True))
        self.of = {stage: handle for group, handle in self.handles.items() for stage in group}
        """Stage → the handle of the deployment that holds it."""
        self.grouped = {stage for group in self.handles for stage in group if len(group) > 1}
        """The stages that share a deployment with another (called through the group's own methods)."""
        self.kv = KVReserver(cfg, self.of["decode"])

    def issuer(self, admitted: AdmittedRequest, trace: RequestTrace) -> Issue:
        """The request's :data:`Issue` (its attempts numbered from 1; the first is sent when the ingress span ends)."""
        attempts = itertools.count(1)

        def context(replay: tuple[int, ...]) -> RequestContext:
            n = next(attempts)  # a re-issued chain's stages count their queue from its own issue time
            return RequestContext(
                request_id=trace.request_id,
                tenant=admitted.tenant,
                deadline=admitted.deadline,
                sent_at=trace.timeline.last if n == 1 else time.time(),
                attempt=n,
                priority=admitted.priority,
                vector=admitted.vector,
                route=admitted.route,
                replay=replay,
            )

        def issue(replay: tuple[int, ...] = ()) -> Awaitable[Started]:
            return with_retries(
                lambda: self.attempt(admitted, context(replay)),
                admitted.deadline,
                REPLICA_LOST,
                max_attempts=self.cfg.server.max_chain_attempts,
            )

        return issue

    async def attempt(self, admitted: AdmittedRequest, ctx: RequestContext) -> Started:
        """Issue one attempt and wait for its decode stream's start (see the module docstring)."""
        responses: list[Any] = []
        upstream: Any = []  # what the next call takes: the media's response, then each group's
        reserved = False
        try:
            if admitted.refs:
                upstream = list(admitted.refs)  # (the first group's, where media is grouped with encode)
            if admitted.refs and self.media is not None:
                media = self.media.process.remote(upstream, ctx)
                responses.append(media)
                # Encode and KV only once the media stage has the items: a slow or hostile download holds no encode
                # call, no decode blocks and no decode request slot while it lasts
                await settled(media, ctx.deadline)
                upstream = media
            for hop in hops(self.topology, bool(admitted.refs)):
                if "prefill" in hop and "decode" not in hop:  # the KV is reserved here (meanwhile encode works)
                    ctx, reserved = await self.kv.reserve(ctx, admitted.kv_blocks)
                    if reserved and not admitted.refs:  # prefill's timeline starts after the reservation
                        upstream = waited("decode.reserve", ctx.sent_at, blocks=admitted.kv_blocks)
                if hop == ("decode",) and reserved:  # its replica is known: sent now, it awaits the prefill there
                    upstream = await pending(upstream, ctx.deadline, "prefill")
                upstream = self._call(hop, upstream, admitted, ctx)
                responses.append(upstream)
                if hop == ("media", "encode"):  # (as above: no KV reserved, no prefill call, until the media is done)
                    await settled(upstream, ctx.deadline, "the media and encode stages")
            first = await next_event(upstream, ctx.deadline)
            if not isinstance(first, StreamStart):
                raise HandoffError(f"the decode stream began with {type(first).__name__}, not its start")
            return Started(responses, ctx, first)
        except BaseException:
            cancel_chain(responses)
            if reserved:  # a reservation no generate may claim now (one already claimed is the stream's to free)
                self.kv.give_back(ctx)
            raise

    def _call(self, hop: Group, upstream: Any, admitted: AdmittedRequest, ctx: RequestContext) -> Any:
        """Call the deployment that holds ``hop`` with what the stage before it gave: a stage alone by its own method,
        a group by :meth:`GroupDeployment.run` (or ``run_stream`` when it ends with decode, reserving the KV there);
        a group that starts with media is given the request's media references."""
        handle, messages, sampling, tools = self.of[hop[0]], admitted.messages, admitted.sampling, admitted.tools
        if hop[0] not in self.grouped:
            if hop == ("encode",):
                return handle.encode.remote(upstream, ctx)
            if hop == ("prefill",):
                return handle.prefill.remote(messages, upstream, sampling, ctx, tools)
            return handle.generate.options(stream=True).remote(upstream, sampling, ctx)
        if hop[-1] == "decode":
            stream = handle.run_stream.options(stream=True)
            return stream.remote(hop, upstream, messages, sampling, ctx, admitted.kv_blocks, tools)
        return handle.run.remote(hop, upstream, messages, sampling, ctx, tools)
