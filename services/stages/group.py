"""A grouped deployment: several stages of one model in one replica (``deployments.topology``: ``E/PD``, ``EP/D``,
``EPD``, ``ME/P/D``, ``ME/PD``, ``MEPD``; :mod:`common.config.topology`).

The replica builds the stage classes it holds — the same :class:`MediaDeployment`, :class:`EncodeDeployment`,
:class:`PrefillDeployment` and :class:`DecodeDeployment` as the split topology's, with their engines, thread pools,
driver threads, budgets, caches, traces and metrics — and wires the hops between them in process: the processed media
as the media stage made them, then :class:`InProcessTransport` (the embeddings as the encoder made them, the KV copied
once into the decode pool's blocks and checked against its seal there). A hop that leaves the group (encode → a
prefill elsewhere; prefill → a decode elsewhere) keeps the model's transport. A stage in a group lowers the priority
(raises the niceness) of its own worker threads only, never the whole process's (the other stages' threads and the
event loop keep theirs).

The ingress calls a group once per request with the stages that request runs (:func:`common.config.topology.hops`; a
group that holds media takes the request's media references):

* :meth:`run_stream` for a group that ends with decode (``PD``, ``EPD``, ``MEPD``): media first when the group holds
  it, so a download holds no decode blocks; then the request's KV is reserved on this replica's own pool (the same
  gate and rules as :meth:`DecodeDeployment.reserve`, no call to make: the stream that claims the reservation runs
  here), while encode works when the group holds it (in ``E/PD`` the call starts once the encode deployment answered:
  Serve resolves its response first); then prefill, then the decode stream, whose events it yields. A reservation no
  stream claimed is dropped when the call ends, whatever ended it.
* :meth:`run` for a group that ends with prefill (``EP``): encode then prefill; the answer is the prefill's handle in
  the model's transport, for the decode deployment (the ingress reserved its KV there before this call). For the
  ``ME`` group (``ME/P/D``, ``ME/PD``): media then encode; the answer is the embeddings' handle in the model's
  transport, for the prefill deployment (the ingress reserves the KV once this call has answered).

The model is loaded once per replica and shared by its stages (their forward passes only read it). Serve sizes the
group as one deployment (:meth:`common.config.ModelStages.group_stage`); for autoscaling see
:meth:`GroupDeployment.record_autoscaling_stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from common.config import PrismConfig
from common.config.topology import Group
from common.errors import Overloaded
from common.kv.transport import KVTransport, make_transport
from common.kv.transport.in_process import InProcessTransport
from common.model.loader import load_model
from common.obs.trace import Traced, waited
from common.protocol.handoff import RequestContext
from common.protocol.sampling import SamplingParams
from services.stages.decode import DecodeDeployment
from services.stages.encode import EncodeDeployment
from services.stages.media import MediaDeployment
from services.stages.prefill import PrefillDeployment


class GroupDeployment:
    def __init__(self, config: dict[str, Any], group: Group, transport: KVTransport | None = None) -> None:
        """``transport``: the hops that leave the group (the model's by default; tests pass the fake backend)."""
        self.cfg = PrismConfig.model_validate(config)
        self.group = group
        lm = load_model(self.cfg.model)  # once: the stages share its weights (forward passes never modify them)
        local = InProcessTransport()

        def outer() -> KVTransport:
            return transport or make_transport(self.cfg.transport)

        self.media: MediaDeployment | None = None
        self.encode: EncodeDeployment | None = None
        self.prefill: PrefillDeployment | None = None
        self.decode: DecodeDeployment | None = None
        if "media" in group:  # (a group that holds media holds encode: the processed media stay in process)
            self.media = MediaDeployment(config, grouped=True)
        if "encode" in group:
            outbound = local if "prefill" in group else outer()
            self.encode = EncodeDeployment(config, outbound, lm=lm, grouped=True, pixels_in_process="media" in group)
        if "prefill" in group:
            inbound = local if "encode" in group else outer()
            outbound = local if "decode" in group else outer()
            self.prefill = PrefillDeployment(config, inbound, outbound, lm=lm)
        if "decode" in group:
            self.decode = DecodeDeployment(config, local if "prefill" in group else outer(), lm=lm, grouped=True)

    async def run(
        self,
        hop: Group,
        upstream: Any,
        messages: list[dict[str, Any]],
        sampling: SamplingParams,
        ctx: RequestContext,
        tools: list[dict[str, Any]] | None = None,
    ) -> Traced[Any]:
        """Media and encode (when ``hop`` holds them) then prefill: the prefill's handle, for the decode deployment —
        or, for a group that ends with encode, the embeddings' handle, for the prefill deployment."""
        upstream = await self._media(hop, upstream, ctx)
        embeddings = await self.encode.encode(upstream, ctx) if "encode" in hop and self.encode else upstream
        if self.prefill is None:
            return embeddings
        return await self.prefill.prefill(messages, embeddings, sampling, ctx, tools)

    async def _media(self, hop: Group, upstream: Any, ctx: RequestContext) -> Any:
        """The processed media, when ``hop`` holds the media stage (``upstream``: the request's media references);
        otherwise ``upstream`` as it came."""
        if "media" in hop and self.media is not None:
            return await self.media.process(upstream, ctx)
        return upstream

    async def run_stream(
        self,
        hop: Group,
        upstream: Any,
        messages: list[dict[str, Any]],
        sampling: SamplingParams,
        ctx: RequestContext,
        kv_blocks: int,
        tools: list[dict[str, Any]] | None = None,
    ):
        """The request's decode events, its KV reserved here before prefill computes (see the module docstring)."""
        assert self.prefill is not None and self.decode is not None
        upstream = await self._media(hop, upstream, ctx)  # (before the reservation: a download holds no KV)
        since = ctx.sent_at
        encoding = None
        if "encode" in hop and self.encode is not None:  # (encode works while the KV is reserved)
            encoding = asyncio.ensure_future(self.encode.encode(upstream, ctx))
        reserving = asyncio.ensure_future(self._reserve(ctx, kv_blocks))
        try:
            if encoding is not None:  # whichever fails first fails the request at once
                await asyncio.wait({encoding, reserving}, return_when=asyncio.FIRST_EXCEPTION)
                if encoding.done():
                    encoding.result()  # (an encode error is not held back until the reservation is granted)
            ctx, reserved = await reserving
            if encoding is not None:
                embeddings = await encoding
            elif reserved and upstream == []:  # text: prefill's timeline starts after the reservation (traced)
                embeddings = waited("decode.reserve", since, blocks=kv_blocks)
            else:
                embeddings = upstream
            pre = await self.prefill.prefill(messages, embeddings, sampling, ctx, tools)
            async with contextlib.aclosing(self.decode.generate(pre, sampling, ctx)) as events:
                async for event in events:  # (closed with this call, whatever ends it: the sequence's KV goes back)
                    yield event
        finally:
            tasks = [t for t in (encoding, reserving) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # (their errors are this call's, or moot)
            # A reservation no stream claimed goes back — also one granted in the instant this call was cancelled;
            # a no-op once the stream claimed it (the stream frees what it holds).
            await self.decode.unreserve(ctx)

    async def _reserve(self, ctx: RequestContext, blocks: int) -> tuple[RequestContext, bool]:
        """This replica's pool leases ``blocks`` for the attempt (waits, or 429 / 504 / 400 as the decode stage
        answers); a migration the pool cannot take now goes on unreserved, as through the ingress
        (:class:`services.ingress.kv_reserver.KVReserver`)."""
        assert self.decode is not None
        if not self.cfg.admission.reserve_kv or blocks <= 0:
            return ctx, False
        try:
            got = await self.decode.reserve(ctx, blocks)
        except Overloaded:
            if ctx.migration:
                return ctx, False
            raise
        outcome = "waited" if got.waited_s > 0 else "reserved"
        return replace(ctx, decode_replica=got.replica, reservation=outcome), True

    def _stages(self) -> list[Any]:
        return [s for s in (self.media, self.encode, self.prefill, self.decode) if s is not None]

    async def stats(self) -> dict[str, Any]:
        """Every grouped stage's counters in one answer (their names do not overlap; the media stage keeps none)."""
        out: dict[str, Any] = {}
        for stage in self._stages():
            if hasattr(stage, "stats"):
                out.update(await stage.stats())
        return out

    def check_health(self) -> None:
        for stage in self._stages():
            if hasattr(stage, "check_health"):
                stage.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The queue depth of the group's last stage, of its media stage, and of every other stage whose
        ``target_queue_per_replica`` is set in the config, each scaled to the group's target by its own (``depth ×
        group target / stage target``): the busiest counts, so the group wants another replica as soon as any of them
        is past its own target. Media counts by default, as a media deployment of its own scales on its requests in
        flight; another stage without a target of its own does not count — its depth is in its own unit (prompt
        tokens, patches), which the default target (4) was never meant for."""
        stages = self.cfg.deployments
        target = stages.group_stage(self.group).target_queue_per_replica
        depth, out = 0.0, {}
        for name, stage in zip(self.group, self._stages(), strict=True):
            got = stage.record_autoscaling_stats()
            own = getattr(stages, name)
            counts = name in (self.group[-1], "media") or "target_queue_per_replica" in own.model_fields_set
            queued = got.pop("queue_depth", 0.0)
            if counts:
                depth = max(depth, queued * target / own.target_queue_per_replica)
            out.update(got)
        return {**out, "queue_depth": depth}
