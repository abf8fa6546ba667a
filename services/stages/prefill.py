"""Prefill deployment: prompt building, span validation and chunked prefill with the prefix cache.

Receives the chat messages (media reduced to markers) and the visual embeddings — never pixels — builds the prompt
with the model's chat template, validates the span map against the embeddings (:func:`common.stages.merge.merge`),
and — once admitted against the replica's token budget (``admission.prefill_token_budget``; waits its turn, tenants
served fairly, or 429 / 504, :mod:`common.admission.stage`) — queues the request on the :class:`PrefillEngine`. The
driver spends ``prefill_chunk_tokens`` per step across queued prompts, shortest remaining first with aging (the
low-latency lane: a text prompt or a prefix-cache hit is not held behind a large image prompt's chunks; batch class
behind interactive), and drops queued prompts whose deadline passed (504).

Two lanes, each an engine with its own driver thread and budget: text-only prompts up to
``admission.lane_max_prompt_tokens`` run on the low-latency lane, everything else on the long lane. A short prompt
therefore never waits for a large image prompt's chunk to finish: the two compute side by side (the trace's
``prefill.queue`` names the lane). The long lane's thread can run at a lower OS priority (``long_lane_nice``; the
replica's own by default, since an image prompt's TTFT is latency too: ``docs/limits.md``).

The visual embeddings arrive through the model's transport (``model.transport``, else ``server.transport``): by value
or as the encode replica's object-store result, or as a NIXL descriptor that is read into this replica's registered
landing arena and checked against the sender's digest (:meth:`KVTransport.receive_embeddings`); the arena slot is
given back once the embeddings are merged into the prompt. The result is a :class:`PrefillOutput` (first token + KV
blocks, exported in the decode pool's token-major layout, sealed with the attempt's key and an XXH3 digest computed
layer by layer as it is exported) that travels through the transport: with ``object_store`` the output itself
travels in the response; with ``nixl`` the KV is exported straight into the transport's registered staging arena and
a small descriptor travels, the decode replica reads the KV from there into its pool's blocks, and a
:class:`~services.stages.releaser.Releaser` frees the slot on the reader's notification or at the request's
deadline. Prompt rendering and tokenisation run in a worker thread so the replica's event loop keeps accepting calls.

Trace: ``prefill.transfer`` (encode done → this call starts: the embeddings' hand-off; for a text-only request, from
the end of the ingress's ``decode.reserve`` span — or from when it sent the call, without a reservation),
``prefill.prompt`` (chat template + span validation + merge), ``prefill.queue`` (waiting for the engine's first
chunk), ``prefill`` (the chunks; prompt tokens, prefix-cache hit, KV blocks as attributes).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from common.admission.stage import StageAdmission, budget_admission
from common.config import PrismConfig
from common.engine.prefill import PrefillEngine, PrefillResult
from common.kv.blocks import seal
from common.kv.transport import KVTransport, make_transport
from common.kv.transport.base import Received
from common.model.loader import LoadedModel, load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import MergedInputs, RequestContext, VisualEmbeddings
from common.protocol.sampling import SamplingParams
from common.stages.merge import merge
from common.stages.prompt import build_prompt
from services.platform.loopback import bind_replica
from services.platform.memory import keep_freed_heap
from services.platform.metrics import Metrics
from services.stages.driver import AwaitedEngine, check_engines
from services.stages.releaser import Releaser
from services.stages.threads import compile_guide, finish_in_thread, nice_thread


@dataclass
class _Lane:
    """One prefill engine with its own driver thread, budget and OS priority."""

    name: str
    engine: PrefillEngine
    runner: AwaitedEngine
    admission: StageAdmission


class PrefillDeployment:
    def __init__(
        self,
        config: dict[str, Any],
        transport: KVTransport | None = None,
        kv_transport: KVTransport | None = None,
        lm: LoadedModel | None = None,
    ) -> None:
        """``transport``: how the visual embeddings arrive and — unless ``kv_transport`` is given (a decode stage in
        this replica: :mod:`services.stages.group`) — how the KV leaves; the model's transport by default. ``lm``:
        the model, when a grouped replica loaded it once for its stages."""
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        keep_freed_heap(self.cfg.deployments.prefill.heap_keep_bytes)  # (activations: no page faults per request)
        self.lm = lm or load_model(self.cfg.model)
        eng, adm = self.cfg.engine, self.cfg.admission
        self.metrics = Metrics("prefill")
        self.transport = transport or make_transport(self.cfg.transport)
        self.kv_transport = kv_transport or self.transport
        self.transport.prepare(sends=self.kv_transport is self.transport)  # (not on the first request's time)
        if self.kv_transport is not self.transport:
            self.kv_transport.prepare(receives=False)
        long_nice = self.cfg.deployments.prefill.long_lane_nice
        self.long = self._lane("long", eng.prefix_cache_blocks, adm.prefill_token_budget, long_nice)
        self.lanes = [self.long]
        self.short: _Lane | None = None
        if adm.lane_max_prompt_tokens:
            quarter = max(1, adm.prefill_token_budget // 4)
            self.short = self._lane("short", eng.prefix_cache_blocks // 4, quarter, 0)
            self.lanes.append(self.short)
        self.releaser = Releaser(self.kv_transport)
        self.metrics.keep_fresh(self._load)

    def _lane(self, name: str, prefix_blocks: int, budget: int, nice: int) -> _Lane:
        eng, adm = self.cfg.engine, self.cfg.admission
        engine = PrefillEngine(
            self.lm,
            block_size=eng.kv_block_size,
            chunk_tokens=eng.prefill_chunk_tokens,
            prefix_cache_blocks=prefix_blocks,
            shared_prefix_scope=eng.shared_cache_scope,
            aging_tokens_per_s=adm.aging_tokens_per_s,
            batch_delay_s=adm.batch_delay_s,
            kv_buffers=self.kv_transport.buffers,  # (NIXL: a slot of the replica's staging arena, registered once)
        )

        # Each lane steps in a thread of its own, niced once when it starts: the long lane's lowered priority stays
        # with its thread and never reaches the low-latency lane's.
        executor = ThreadPoolExecutor(1, f"prism-prefill-{name}", initializer=nice_thread, initargs=(nice,))
        runner = AwaitedEngine(
            lambda: engine.step(eng.prefill_chunk_tokens),
            engine.has_work,
            lambda results: ((r.request_id, r) for r in results),
            engine.cancel,
            engine.expire,
            "prefill",
            executor,
            orphaned=lambda result: self.kv_transport.discard(result.output),
        )
        return _Lane(name, engine, runner, budget_admission("prefill", "tokens", budget, adm, self.metrics))

    def _lane_for(self, merged: MergedInputs) -> _Lane:
        short = self.short is not None and not merged.spans
        if short and len(merged.token_ids) <= self.cfg.admission.lane_max_prompt_tokens:
            return self.short  # type: ignore[return-value]
        return self.long

    async def prefill(
        self,
        messages: list[dict[str, Any]],
        embeddings: Traced[Any] | list[VisualEmbeddings],
        sampling: SamplingParams,
        ctx: RequestContext,
        tools: list[dict[str, Any]] | None = None,
    ) -> Traced[Any]:
        """The prefill result as the KV transport's handle (the output itself over the object store); ``tools``: the
        function definitions the chat template renders into the prompt."""
        timeline = Timeline.after(embeddings, ctx.sent_at)
        handle = unwrap(embeddings)
        visual, free = await self._receive(handle)
        try:
            nbytes = sum(int(e.embeddings.nbytes) for e in visual)
            by_value = isinstance(handle, list) and self.transport.name != "in_process"  # (the response carried them)
            backend = "object_store" if by_value else self.transport.name
            transfer = timeline.mark("prefill.transfer", backend=backend, bytes=nbytes)
            if visual:
                self.metrics.transfer(backend, "embeddings", nbytes, transfer.duration_s)
            ctx.check_deadline("prefill")
            await compile_guide(self.lm, sampling.guide)  # (the engine's own check then finds it cached)
            merged = await asyncio.to_thread(self._merge, messages, visual, tools)
        finally:
            free()  # (merged: the embeddings' landing memory goes back)
        prep = timeline.mark("prefill.prompt", prompt_tokens=len(merged.token_ids))
        tokens, lane = len(merged.token_ids), self._lane_for(merged)
        result: PrefillResult | None = None
        try:
            async with lane.admission.held(ctx, tokens, tokens):
                submit = lambda: self._submit(lane, ctx, merged, sampling)  # noqa: E731
                result = await lane.runner.run(ctx.key, submit)
            self._trace(timeline, lane, result, transfer.duration_s, prep.duration_s)
            sealed = seal(result.output, ctx.key)  # (its checksum was computed with the export, in the engine thread)
            out = self.kv_transport.publish(sealed, expires_at=ctx.deadline)
        except BaseException:
            if result is not None:  # exported, never published: its staging memory goes back now
                self.kv_transport.discard(result.output)
            raise
        finally:
            self._load()
        self.releaser.kick()
        return timeline.wrap(out)

    async def _receive(self, handle: Any) -> Received:
        """The visual embeddings behind the encode stage's handle (read off the event loop when they are elsewhere).
        A caller that goes away during the read still waits for it, and gives back the memory it landed in."""
        if isinstance(handle, list):
            return self.transport.receive_embeddings(handle)
        return await finish_in_thread(lambda: self.transport.receive_embeddings(handle), lambda got: got[1]())

    def _merge(
        self, messages: list[dict[str, Any]], visual: list[VisualEmbeddings], tools: list[dict[str, Any]] | None
    ) -> MergedInputs:
        prompt = build_prompt(self.lm, messages, visual, self.cfg.engine.max_prompt_tokens, tools)
        return merge(self.lm, prompt, visual)

    def _trace(self, timeline: Timeline, lane: _Lane, result: PrefillResult, transfer_s: float, prep_s: float) -> None:
        stats, kv, engine = result.stats, result.output.kv, lane.engine
        bs = engine.block_size
        queue = timeline.mark_until("prefill.queue", stats.started_at, lane=lane.name)
        work = timeline.mark(
            "prefill",
            prompt_tokens=stats.prompt_tokens,
            prefix_cached_tokens=stats.cached_tokens,
            prefix_cached_visual_tokens=stats.cached_visual_tokens,
            chunks=len(stats.chunks),
            kv_blocks=kv.num_blocks,
            kv_bytes=kv.nbytes,
        )
        self.metrics.stage_time(transfer_s + queue.duration_s, prep_s + work.duration_s)
        if engine.prefix is not None and engine.pool is not None:
            hits = stats.cached_tokens // bs
            self.metrics.cache_lookups("prefix", hits, max(0, stats.prompt_tokens // bs - hits))
            block_bytes = kv.nbytes // max(1, kv.num_blocks)
            cached = sum(len(x.engine.prefix) for x in self.lanes if x.engine.prefix is not None)
            self.metrics.cache_bytes("prefix", cached * block_bytes)

    def _submit(self, lane: _Lane, ctx: RequestContext, merged: MergedInputs, sampling: SamplingParams) -> None:
        lane.engine.submit(
            ctx.key,
            merged,
            sampling,
            tenant=ctx.tenant,
            arrival=ctx.sent_at,
            batch=ctx.batch,
            deadline=ctx.monotonic_deadline(),
        )
        self._load()

    async def stats(self) -> dict[str, int]:
        """Work counters (prompt tokens computed, per lane and in all) and what the budgets hold."""
        out = {f"{x.name}_computed_tokens": x.engine.computed_tokens for x in self.lanes}
        out["computed_tokens"] = sum(x.engine.computed_tokens for x in self.lanes)
        out["admitted_tokens"] = sum(x.admission.gate.used for x in self.lanes)
        return out

    @property
    def queued_tokens(self) -> int:
        return sum(x.engine.queued_tokens for x in self.lanes)

    def _load(self) -> None:
        self.metrics.load(sum(len(x.runner.waiting) for x in self.lanes), self.queued_tokens)
        self.metrics.grammar()

    def check_health(self) -> None:
        """Serve's health check: unhealthy once a lane's engine failed steps in a row (:func:`check_engines`)."""
        check_engines("prefill", [lane.runner.driver.failures for lane in self.lanes])

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.queued_tokens)}
