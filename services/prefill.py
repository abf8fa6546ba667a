"""Prefill deployment: prompt building, span validation and chunked prefill with the prefix cache.

Receives the chat messages (media reduced to markers) and the visual embeddings — never pixels — builds the prompt
with the model's chat template, validates the span map against the embeddings (:func:`common.stages.merge.merge`),
and queues the request on the :class:`PrefillEngine`. The driver spends ``prefill_chunk_tokens`` per step across
queued prompts. The result is a :class:`PrefillOutput` (first token + KV blocks as numpy) that travels through the
object store — or, with ``server.transport: nixl``, a small :class:`RemotePrefillOutput` descriptor; the decode
replica then reads the KV straight from this replica's memory, which is freed on its notification or at the
request's deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

from common.config import PrismConfig
from common.engine.prefill import PrefillEngine, PrefillResult
from common.kv.nixl_transport import NixlKVSender, RemotePrefillOutput
from common.model.loader import load_model
from common.protocol.handoff import PrefillOutput, VisualEmbeddings
from common.protocol.sampling import SamplingParams
from common.stages.merge import merge
from common.stages.prompt import build_prompt
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

    async def prefill(
        self,
        messages: list[dict[str, Any]],
        embeddings: list[VisualEmbeddings],
        sampling: SamplingParams,
        request_id: str,
        tenant: str,
        deadline: float,
    ) -> PrefillOutput | RemotePrefillOutput:
        """The prefill result; with the NIXL transport, a descriptor the decode replica reads the KV through."""
        check_deadline(deadline, "prefill")
        prompt = build_prompt(self.lm, messages, embeddings, self.cfg.engine.max_prompt_tokens)
        merged = merge(self.lm, prompt, embeddings)
        result: PrefillResult = await self.runner.run(
            request_id, lambda: self.engine.submit(request_id, merged, sampling, tenant=tenant)
        )
        if self.nixl is None:
            return result.output
        remote = self.nixl.publish(result.output, expires_at=deadline)
        if self._nixl_poller is None or self._nixl_poller.done():
            self._nixl_poller = asyncio.get_running_loop().create_task(self._poll_nixl())
        return remote

    async def _poll_nixl(self) -> None:
        """Free published KV once read (or expired); stops when nothing is held."""
        assert self.nixl is not None
        while await asyncio.to_thread(self.nixl.poll):
            await asyncio.sleep(0.02)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"queue_depth": float(self.engine.queued_tokens)}
