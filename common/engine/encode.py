"""Encode engine: encoder cache in front of the shape-bucketed batcher in front of the vision tower.

Lifecycle of one request: ``submit`` looks every media item up in the encoder cache (key: tenant scope, media
digest, processor key, encoder/projector revision + dtype). If all hit, the embeddings come back at once. Misses go
to the :class:`EncoderBatcher`; each :meth:`step` encodes one batch (items of several requests may share it), stores
each result with its share of the batch's wall time as recompute cost, and returns the requests that are now
complete, their embeddings in media order. ``cancel`` drops a request's queued items; :meth:`expire` drops those of
requests whose deadline (given at submit, engine clock) passed while they waited, so no batch computes for nobody.

Each request's :class:`EncodeStats` (cache hits/misses, when it was queued, when its first batch started) stays
readable through :meth:`pop_stats` until its caller collects it, so the stage can trace queue wait and work apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.cache.encoder_cache import EncoderCache, EncoderCacheKey
from common.cache.processor_cache import canonical_options
from common.model.loader import LoadedModel
from common.protocol.handoff import ProcessedMedia, VisualEmbeddings
from common.sched.encoder_batcher import EncodeItem, EncoderBatcher
from common.stages.encode import encode_media


@dataclass
class _Pending:
    slots: list[VisualEmbeddings | None]
    keys: list[EncoderCacheKey | None]


@dataclass
class EncodeStats:
    """One request's encoder-cache outcome and timing (engine clock)."""

    cache_hits: int = 0
    cache_misses: int = 0
    submitted_at: float = 0.0
    started_at: float | None = None
    """Start of the first batch that held one of its items; ``None`` if every item hit the cache."""


class EncodeEngine:
    def __init__(
        self,
        lm: LoadedModel,
        batcher: EncoderBatcher,
        cache: EncoderCache | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lm = lm
        self.batcher = batcher
        self.cache = cache
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._stats: dict[str, EncodeStats] = {}
        self._deadlines: dict[str, float] = {}
        self.batches = 0
        """Batches run through the vision tower (work counter: tests check admission refused before it)."""
        self.items_encoded = 0

    def processor_key(self, options: dict[str, Any] | None) -> str:
        return ":".join(
            (
                type(self.lm.image_processor).__name__,
                self.lm.contract.processor_revision,
                canonical_options(options or {}),
            )
        )

    def submit(
        self,
        request_id: str,
        items: list[ProcessedMedia],
        tenant: str = "default",
        processor_options: dict[str, Any] | None = None,
        deadline: float | None = None,
        batch: bool = False,
    ) -> list[VisualEmbeddings] | None:
        """Embeddings now if every item hits the cache; otherwise ``None`` and the request completes in a step.
        ``batch``: batch-class traffic, whose misses the batcher ranks behind interactive ones."""
        if request_id in self._pending:
            raise ValueError(f"request {request_id} is already encoding")
        state = _Pending(slots=[None] * len(items), keys=[None] * len(items))
        pkey = self.processor_key(processor_options)
        now = self.clock()
        stats = self._stats[request_id] = EncodeStats(submitted_at=now)
        for i, item in enumerate(items):
            if self.cache is not None:
                key = self.cache.key(tenant, item.media_digest, pkey, self.lm.contract.encoder_key)
                state.keys[i] = key
                cached = self.cache.get(key)
                if cached is not None:
                    state.slots[i] = self._wrap(item, cached)
                    stats.cache_hits += 1
                    continue
            stats.cache_misses += 1
            self.batcher.add(EncodeItem(request_id, item, now, batch))
        if all(s is not None for s in state.slots):
            return list(state.slots)  # type: ignore[arg-type]
        self._pending[request_id] = state
        if deadline is not None:
            self._deadlines[request_id] = deadline
        return None

    def uncached_patches(
        self, items: list[ProcessedMedia], tenant: str = "default", processor_options: dict[str, Any] | None = None
    ) -> int:
        """Patches of the items the encoder cache does not hold (what encoding this request would cost now)."""
        if self.cache is None:
            return sum(m.patches for m in items)
        pkey = self.processor_key(processor_options)
        enc = self.lm.contract.encoder_key
        return sum(m.patches for m in items if self.cache.key(tenant, m.media_digest, pkey, enc) not in self.cache)

    def cancel(self, request_id: str) -> bool:
        self.batcher.remove_request(request_id)
        self._stats.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        return self._pending.pop(request_id, None) is not None

    def expire(self) -> list[str]:
        """Drop the requests whose deadline passed while they waited; their ids."""
        now = self.clock()
        gone = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for rid in gone:
            self.cancel(rid)
        return gone

    def pop_stats(self, request_id: str) -> EncodeStats | None:
        """The request's stats, forgotten by the engine (call once its result or failure is known)."""
        return self._stats.pop(request_id, None)

    def has_work(self) -> bool:
        return self.batcher.pending_items > 0

    def step(self) -> dict[str, list[VisualEmbeddings]]:
        now = self.clock()
        batch = self.batcher.next_batch(now)
        if not batch:
            return {}
        for item in batch:
            stats = self._stats.get(item.request_id)
            if stats is not None and stats.started_at is None:
                stats.started_at = now
        start = time.perf_counter()
        outputs = encode_media(self.lm, [item.media for item in batch])
        elapsed = time.perf_counter() - start
        self.batches += 1
        self.items_encoded += len(batch)
        total = sum(item.patches for item in batch)
        completed = {}
        for item, emb in zip(batch, outputs, strict=True):
            state = self._pending.get(item.request_id)
            if state is None:
                continue
            index = item.media.media_index
            key = state.keys[index]
            if self.cache is not None and key is not None:
                self.cache.put(key, emb.embeddings, recompute_cost=elapsed * item.patches / total)
            state.slots[index] = emb
            if all(s is not None for s in state.slots):
                completed[item.request_id] = list(state.slots)
                del self._pending[item.request_id]
                self._deadlines.pop(item.request_id, None)
        return completed

    def _wrap(self, item: ProcessedMedia, embeddings) -> VisualEmbeddings:
        return VisualEmbeddings(
            media_index=item.media_index,
            modality=item.modality,
            media_digest=item.media_digest,
            embeddings=embeddings,
            grid_thw=item.grid_thw,
            encoder_revision=self.lm.contract.encoder_key,
        )
