"""Prefill deployment: prompt building, span validation and chunked prefill with the prefix cache.

Receives the chat messages (media reduced to markers) and the visual embeddings — never pixels — builds the prompt
with the model's chat template, validates the span map against the embeddings (:func:`common.stages.merge.merge`),
and queues the request on the :class:`PrefillEngine`. The driver spends ``prefill_chunk_tokens`` per step across
queued prompts. The result is a :class:`PrefillOutput` (first token + KV blocks as numpy) that travels through the
object store — or, with ``server.transport: nixl``, a small :class:`RemotePrefillOutput` descriptor; the decode
replica then reads the KV straight from this replica's memory, which is freed on its notification or at the
request's deadline.

Trace: ``prefill.transfer`` (encode done → this call starts: the embeddings' hand-off; for a text-only request,
ingress sent → start), ``prefill.prompt`` (chat template + span validation + merge), ``prefill.queue`` (waiting for
the engine's first chunk), ``prefill`` (the chunks; prompt tokens, prefix-cache hit, KV blocks as attributes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.config import PrismConfig
from common.engine.prefill import PrefillEngine, PrefillResult
from common.kv.nixl_transport import NixlKVSender, RemotePrefillOutput
from common.model.loader import load_model
from common.obs.trace import Timeline, Traced, unwrap
from common.protocol.handoff import PrefillOutput, VisualEmbeddings
from common.protocol.sampling import SamplingParams
from common.stages.merge import merge
from common.stages.prompt import build_prompt
from services.metrics import Metrics
from services.runtime import AwaitedEngine, check_deadline


class PrefillDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = PrismConfig.model_validate(config)
        self.lm = load_model(self.cfg.model)
        eng = self.cfg.engine
        self.engine = PrefillEngine(
            self.lm,
            block_size=eng.kv_block_size,
            chunk_tokens=eng.prefill_chunk_tokens,
            prefix_cache_blocks=eng.prefix_cache_blocks,
            shared_prefix_scope=eng.shared_cache_scope,
        )
        self.nixl = NixlKVSender() if self.cfg.server.transport == "nixl" else None
        self._nixl_poller: asyncio.Task | None = None
        self.runner = AwaitedEngine(
            lambda: self.engine.step(eng.prefill_chunk_tokens),
            self.engine.has_work,
            lambda results: ((r.request_id, r) for r in results),
            self.engine.cancel,
        )
        self.metrics = Metrics("prefill")
        self.metrics.keep_fresh(self._load)

    async def prefill(
        self,
        messages: list[dict[str, Any]],
        embeddings: Traced[list[VisualEmbeddings]] | list[VisualEmbeddings],
        sampling: SamplingParams,
        request_id: str,
        tenant: str,
        deadline: float,
        sent_at: float | None = None,
    ) -> Traced[PrefillOutput | RemotePrefillOutput]:
        """The prefill result; with the NIXL transport, a descriptor the decode replica reads the KV through."""
        timeline = Timeline.after(embeddings, sent_at if sent_at is not None else time.time())
        visual = unwrap(embeddings)
        nbytes = sum(int(e.embeddings.nbytes) for e in visual)
        transfer = timeline.mark("prefill.transfer", backend="object_store", bytes=nbytes)
        if visual:
            self.metrics.transfer("object_store", "embeddings", nbytes, transfer.duration_s)
        check_deadline(deadline, "prefill")
        prompt = build_prompt(self.lm, messages, visual, self.cfg.engine.max_prompt_tokens)
        merged = merge(self.lm, prompt, visual)
        prep = timeline.mark("prefill.prompt", prompt_tokens=len(merged.token_ids))
        try:
            result: PrefillResult = await self.runner.run(
                request_id, lambda: self._submit(request_id, merged, sampling, tenant)
            )
        finally:
            self._load()
        self._trace(timeline, result, transfer.duration_s, prep.duration_s)
        if self.nixl is None:
            return timeline.wrap(result.output)
        remote = self.nixl.publish(result.output, expires_at=deadline)
        if self._nixl_poller is None or self._nixl_poller.done():
            self._nixl_poller = asyncio.get_running_loop().create_task(self._poll_nixl())
        return timeline.wrap(remote)

    def _trace(self, timeline: Timeline, result: PrefillResult, transfer_s: float, prep_s: float) -> None:
        stats, kv, bs = result.stats, result.output.kv, self.engine.block_size
        queue = timeline.mark_until("prefill.queue", stats.started_at)
        work = timeline.mark(
            "prefill",
            prompt_tokens=stats.prompt_tokens,
            prefix_cached_tokens=stats.cached_tokens,
            chunks=len(stats.chunks),
            kv_blocks=kv.num_blocks,
            kv_bytes=kv.nbytes,
        )
        self.metrics.stage_time(transfer_s + queue.duration_s, prep_s + work.duration_s)
        if self.engine.prefix is not None and self.engine.pool is not None:
            hits = stats.cached_tokens // bs
            self.metrics.cache_lookups("prefix", hits, max(0, stats.prompt_tokens // bs - hits))
            block_bytes = kv.nbytes // max(1, kv.num_blocks)
            self.metrics.cache_bytes("prefix", len(self.engine.prefix) * block_bytes)

    def _submit(self, request_id: str, merged: Any, sampling: SamplingParams, tenant: str) -> None:
        self.engine.submit(request_id, merged, sampling, tenant=tenant)
        self._load()

    def _load(self) -> None:
        self.metrics.load(len(self.runner.waiting), self.engine.queued_tokens)

    async def _poll_nixl(self) -> None:
        """Free published KV once read (or expired); stops when nothing is held."""
        assert self.nixl is not None
        while await asyncio.to_thread(self.nixl.poll):
            await asyncio.sleep(0.02)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.engine.queued_tokens)}
