"""Prefill engine: token-budgeted chunked prefill with a multimodal prefix cache.

Lifecycle of one request, as queues:

``submit`` → prefix-cache lookup (chained block hashes; at least one token is always computed for the first-token
logits; for a family that may not split a media span the hit is trimmed so recompute never starts inside one —
LLaVA and Qwen2-VL may, so the same image asked a new question reuses its KV up to the image's last full block)
→ **queued** with its cached KV loaded → each :meth:`step` spends a token budget across queued requests in FIFO
order, one chunk per request at a time (chunk ends respect media spans where the family asks for it,
:mod:`common.engine.chunking`); a step ends as soon as a request finishes, so its result is never held behind
lower-ranked chunks → after its last chunk a request samples its first token, exports its KV as :class:`KVBlocks`,
inserts its new full blocks into the prefix cache, and leaves as a :class:`PrefillOutput`. :meth:`cancel` drops a
queued request at any point; :meth:`expire` drops those whose deadline (given at submit, engine clock) passed.

Rank (the low-latency lane): a request's virtual arrival is its arrival plus the tokens it still has to compute
÷ ``aging_tokens_per_s`` (plus ``batch_delay_s`` for batch traffic). Short prompts and prefix-cache hits (few tokens
left to compute) therefore go before a large image prompt that arrived a moment earlier, and are not held behind
its chunks; the large prompt is overtaken only by work that arrived less than its own size ÷ aging earlier than it
would rank, so it is never starved. Without ``aging_tokens_per_s`` the order is FIFO.

Requests are computed one chunk at a time (no padding across prompts), which keeps the result bit-identical to an
unchunked, unbatched prefill up to floating-point reduction order.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from common.admission.budget import rank
from common.cache.scope import cache_scope
from common.engine.chunking import next_chunk_end, usable_prefix_blocks
from common.grammar.compiler import compiler_for
from common.grammar.masks import MaskBuffer, mask_row
from common.kv.blocks import Buffers, export_sealed_kv, fresh_buffers, to_torch
from common.kv.digest import SCHEME
from common.kv.pool import KVPool
from common.kv.prefix_cache import PrefixCache
from common.kv.prefix_hash import block_hashes
from common.model.loader import LoadedModel
from common.protocol.handoff import KVBlocks, MergedInputs, PrefillOutput
from common.protocol.sampling import SamplingParams
from common.stages.sampler import first_tokens, log_probs


@dataclass
class PrefillStats:
    prompt_tokens: int
    cached_tokens: int
    cached_visual_tokens: int = 0
    """Of ``cached_tokens``, those at media positions: how much of the prompt's images the prefix cache spared."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    started_at: float | None = None
    """When its first chunk started (engine clock): queue wait and compute are told apart by it."""

    @property
    def computed_tokens(self) -> int:
        return sum(e - s for s, e in self.chunks)


@dataclass
class _State:
    request_id: str
    merged: MergedInputs
    sampling: SamplingParams
    hashes: list[bytes]
    cache: DynamicCache
    positions: torch.Tensor | None
    rope_delta: int
    done: int
    stats: PrefillStats
    rank: float = 0.0
    deadline: float | None = None
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    output: PrefillOutput
    stats: PrefillStats


class PrefillEngine:
    def __init__(
        self,
        lm: LoadedModel,
        block_size: int = 16,
        chunk_tokens: int = 512,
        prefix_cache_blocks: int = 0,
        shared_prefix_scope: bool = False,
        clock: Callable[[], float] = time.monotonic,
        aging_tokens_per_s: float | None = None,
        batch_delay_s: float = 0.0,
        kv_buffers: Buffers = fresh_buffers,
    ) -> None:
        """``kv_buffers``: where a finished prompt's KV is exported (its transport's staging memory, by default
        fresh arrays)."""
        self.lm = lm
        self.kv_buffers = kv_buffers
        self.aging, self.batch_delay_s = aging_tokens_per_s, batch_delay_s
        self.computed_tokens = 0
        """Prompt tokens computed over the engine's life (work counter: tests check admission refused before it)."""
        self.clock = clock
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.shared_scope = shared_prefix_scope
        self.pool: KVPool | None = None
        self.prefix: PrefixCache | None = None
        if prefix_cache_blocks > 0:
            self.pool = KVPool(prefix_cache_blocks, block_size, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
            self.prefix = PrefixCache(self.pool)
        self._queue: OrderedDict[str, _State] = OrderedDict()
        self._masks: MaskBuffer | None = None

    # ---- queue ----------------------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        merged: MergedInputs,
        sampling: SamplingParams,
        tenant: str = "default",
        arrival: float | None = None,
        batch: bool = False,
        deadline: float | None = None,
    ) -> None:
        """Queue a prompt; ``arrival`` (any clock, the same for every request) and ``batch`` set its rank,
        ``deadline`` (engine clock) when :meth:`expire` drops it."""
        if request_id in self._queue:
            raise ValueError(f"request {request_id} is already queued")
        if sampling.guide is not None:
            compiler_for(self.lm).check(sampling.guide)  # (400 before any compute if it does not compile)
        lm, bs = self.lm, self.block_size
        n = len(merged.token_ids)
        token_ids = torch.from_numpy(merged.token_ids)
        positions, rope_delta = lm.adapter.prefill_positions(lm.model, token_ids, merged.spans)
        cache = DynamicCache(config=lm.text_config)
        hashes: list[bytes] = []
        hit = 0
        if self.prefix is not None:
            scope = cache_scope(tenant, self.shared_scope)
            hashes = block_hashes(merged.token_ids, merged.spans, bs, lm.contract.model_revision, scope)
            blocks = self.prefix.lookup(hashes[: (n - 1) // bs])  # keep ≥1 token to compute the logits
            hit = usable_prefix_blocks(len(blocks), bs, merged.spans, lm.adapter.allows_span_split)
            if hit:
                self._load_prefix(cache, blocks[:hit])
        visual = sum(max(0, min(span.end, hit * bs) - span.prompt_token_start) for span in merged.spans)
        stats = PrefillStats(prompt_tokens=n, cached_tokens=hit * bs, cached_visual_tokens=visual)
        arrival = self.clock() if arrival is None else arrival
        order = arrival if self.aging is None else rank(arrival, n - hit * bs, self.aging, batch, self.batch_delay_s)
        self._queue[request_id] = _State(
            request_id,
            merged,
            sampling.resolved(),
            hashes,
            cache,
            positions,
            rope_delta,
            hit * bs,
            stats,
            order,
            deadline,
        )

    def cancel(self, request_id: str) -> bool:
        return self._queue.pop(request_id, None) is not None

    def expire(self) -> list[str]:
        """Drop the queued requests whose deadline passed; their ids."""
        now = self.clock()
        gone = [rid for rid, s in self._queue.items() if s.deadline is not None and s.deadline <= now]
        for rid in gone:
            del self._queue[rid]
        return gone

    def has_work(self) -> bool:
        return bool(self._queue)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute: the prefill stage's queue depth for autoscaling."""
        # (a copy: the stage reads this from its event loop while the engine's thread may be stepping)
        return sum(len(s.merged.token_ids) - s.done for s in list(self._queue.values()))

    # ---- compute --------------------------------------------------------------------------------------------
    def step(self, token_budget: int) -> list[PrefillResult]:
        """Compute up to ``token_budget`` prompt tokens (a chunk may exceed it only to keep a media span whole)."""
        finished = []
        spent = 0
        for state in sorted(self._queue.values(), key=lambda st: st.rank):  # (stable: FIFO among equal ranks)
            if spent >= token_budget:
                break
            n = len(state.merged.token_ids)
            end = next_chunk_end(
                state.done, n, token_budget - spent, state.merged.spans, self.lm.adapter.allows_span_split
            )
            if state.stats.started_at is None:
                state.stats.started_at = self.clock()
            self._run_chunk(state, state.done, end)
            self.computed_tokens += end - state.done
            spent += end - state.done
            state.stats.chunks.append((state.done, end))
            state.done = end
            if end == n:
                del self._queue[state.request_id]
                finished.append(self._finish(state))
                break  # hand it over now: the caller should not wait for lower-ranked chunks (batching is per chunk)
        return finished

    def run(self, request_id: str, merged: MergedInputs, sampling: SamplingParams, tenant: str = "default"):
        """Prefill one request to completion in ``chunk_tokens`` chunks."""
        self.submit(request_id, merged, sampling, tenant)
        while True:
            for result in self.step(self.chunk_tokens):
                if result.request_id == request_id:
                    return result

    def _run_chunk(self, state: _State, start: int, end: int) -> None:
        lm = self.lm
        with torch.inference_mode():
            embeds = torch.from_numpy(state.merged.inputs_embeds[start:end]).to(lm.dtype)[None]
            positions = None if state.positions is None else state.positions[..., start:end]
            out = lm.adapter.language_model(lm.model)(
                inputs_embeds=embeds, position_ids=positions, cache=state.cache, use_cache=True
            )
            state.logits = lm.model.lm_head(out.last_hidden_state[:, -1:, :])[0, -1]

    def _finish(self, state: _State) -> PrefillResult:
        assert state.logits is not None
        # (the raw distribution: before the mask)
        raw = log_probs(state.logits) if state.sampling.logprobs is not None else None
        if state.sampling.guide is not None:  # the first token obeys the grammar too
            with torch.inference_mode():
                mask_row(state.logits, compiler_for(self.lm).matcher(state.sampling.guide), self._mask_buffer())
        first, first_logprob, forks = first_tokens(state.logits, raw, state.sampling)
        kv, checksum = export_sealed_kv(state.cache, self.block_size, self.kv_buffers)
        if self.prefix is not None:
            self._insert_prefix(state.hashes, kv, state.stats.cached_tokens // self.block_size)
        output = PrefillOutput(
            prompt_token_ids=state.merged.token_ids,
            first_token_id=first,
            kv=kv,
            rope_delta=state.rope_delta,
            model_revision=self.lm.contract.model_revision,
            checksum=checksum,  # (the stage's seal binds it to the attempt)
            checksum_scheme=SCHEME,
            first_logprob=first_logprob,
            forks=forks,
        )
        return PrefillResult(state.request_id, output, state.stats)

    # ---- prefix cache plumbing -----------------------------------------------------------------------------
    def _load_prefix(self, cache: DynamicCache, blocks: list[int]) -> None:
        assert self.pool is not None
        keys, values = self.pool.load_tokens(blocks)  # a copy: the cache never aliases pool blocks
        for i in range(self.lm.kv_shape[0]):
            cache.update(keys[i][None], values[i][None], i)

    def _insert_prefix(self, hashes: list[bytes], kv: KVBlocks, already: int) -> None:
        """Copy this prompt's new full blocks into the cache's pool; stop at the first one that does not fit
        (later blocks of the chain are unreachable without it)."""
        assert self.pool is not None and self.prefix is not None
        for i in range(already, len(hashes)):
            if hashes[i] in self.prefix:
                continue
            got = self.pool.take_unreserved(1) or (self.prefix.reclaim(1) and self.pool.take_unreserved(1))
            if not got:
                return
            block = got[0]
            self.pool.store_blocks(
                got, to_torch(kv.keys[:, i : i + 1], kv.dtype), to_torch(kv.values[:, i : i + 1], kv.dtype)
            )
            inserted = self.prefix.insert(hashes[i], block)
            self.pool.unref([block])  # the cache now holds the only reference (or none, if it refused)
            if not inserted:
                return

    def _mask_buffer(self) -> MaskBuffer:
        if self._masks is None:
            self._masks = MaskBuffer(int(self.lm.text_config.vocab_size))
        return self._masks
