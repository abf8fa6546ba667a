"""Continuous-batching decode engine over the paged KV pool.

Queues and lifecycle of one sequence:

``submit`` → (lease queue, if the pool is full) → **admitted**: its prefill KV blocks are copied into pool blocks
and its first token (sampled by prefill) is emitted → **running**; or, when the lease can be had at once,
``claim`` → **landing**: the blocks are allocated before the KV is here, and the transport moves the hand-off straight
into them (the decode stage, outside the engine's lock) → ``start`` → **running**: every :meth:`step` generates one
token for up to ``max_batch`` running sequences in a single forward pass → finished (EOS / stop string / max_tokens),
cancelled, past its deadline (``timeout`` event) or hit by a failed step (``error`` event) → its lease is released,
which may admit waiting sequences. Sequences join and leave the batch at every step.

**Queues** (:mod:`common.engine.queues`): how a sequence gets its lease and blocks (``submit``, ``claim`` /
``start``) and leaves them (``cancel``). **Reservations** (KV before prefill, :mod:`common.engine.reservations`): the
decode stage may take a sequence's lease before prefill computes it; the sequence's ``submit`` (or ``claim``) then
claims it.

Each running sequence's state is a :class:`common.engine.sequence.RunningSequence`. A step
(:func:`common.engine.decode_logits.step_logits`) writes each sequence's new key/value straight into its pool slot and
attends over its block table (:mod:`common.kv.paged_attention`); a sequence takes a new block only when its last one
is full, always inside its lease (reserved for prompt + ``max_tokens`` at submit), so a running sequence can never run
out of KV.
Each token is sampled with the request's ``(seed, step)`` rule, so batching never changes what a sequence says.

**Replay** (decode migration): a sequence whose first replica died mid-generation is submitted again, on a live
replica, with the tokens its client already received. Its prompt's KV comes from prefill as the first time; then the
received tokens are fed through ordinary decode steps — in the batch like any other sequence — but *forced* instead
of sampled and not emitted, while the stop state, penalty counts and step index follow them exactly as they did
the first time. The first sampled token after the replay therefore has the same KV, step (seed) and stop state as on
the lost replica: the stream continues as if nothing happened. Every forced token is also sampled and compared
(sampling is deterministic: greedy, or seeded per step); a mismatch — a rebuild that did not reproduce the original
state — is counted in :attr:`DecodeEngine.replay_mismatches` and logged, and the forced token is kept (it is what the
client saw).

**Choices** (``n`` > 1): one prefill, one hand-off, one lease for the request; :meth:`_begin` forks it into ``n``
sequences. The prompt's full blocks are shared (each choice references them: reference count ``n``); each choice
after the first copies the prompt's partial last block into a block of its own (it writes its next tokens there) and
allocates its own blocks from then on. Choice ``i`` samples with its own seed (:meth:`SamplingParams.for_choice`),
stop state, penalties and grammar, and starts from prefill's ``forks[i-1]``; its events carry its ``index``. The
lease (:func:`common.protocol.vector.choices_blocks`) goes back when the last choice ends; an abort (deadline, failed
step, a grammar failure) ends every choice of the request. A request of ``n`` > 1 is not replayed (no migration).

**Grammars** (structured outputs, :mod:`common.grammar`): a sequence whose sampling carries a guide holds a matcher,
advanced by every token it emits or replays (prefill's first token included); each step fills the masks of all
constrained sequences in the batch at once and applies them to their logits rows only, before sampling. A sequence
whose grammar is complete finishes with ``stop``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import llguidance
import torch

from common.engine.decode_forward import DecodeForward
from common.engine.decode_logits import StepMasks, step_logits
from common.engine.queues import SequenceQueues
from common.engine.sequence import EngineFinish, RunningSequence, TokenEvent
from common.grammar.compiler import compiler_for
from common.kv.native import load_decode_kernel
from common.kv.paged_attention import enable_paged_attention
from common.kv.pool import KVPool, Lease
from common.model.loader import LoadedModel
from common.protocol.handoff import Prefilled, PrefillOutput, TokenLogprob
from common.protocol.sampling import SamplingParams
from common.stages.sampler import plain_greedy, sample_token, token_logprob
from common.stages.stops import StopChecker

log = logging.getLogger("prism.engine.decode")


class DecodeEngine(SequenceQueues):
    def __init__(
        self,
        lm: LoadedModel,
        pool: KVPool,
        max_batch: int = 32,
        clock: Callable[[], float] = time.monotonic,
        prefer_contiguous: bool = True,
        native_attention: bool = True,
        lean_forward: bool = True,
    ) -> None:
        if pool.kv_shape != lm.kv_shape or pool.dtype != lm.dtype:
            raise ValueError("KV pool geometry/dtype does not match the model")
        enable_paged_attention(lm.text_config)
        # The native kernel reads fp32 and bf16 pools on the CPU; anything else (or no compiler) keeps PyTorch's path.
        native = native_attention and pool.dtype in (torch.float32, torch.bfloat16) and pool.keys.device.type == "cpu"
        self.kernel = load_decode_kernel() if native else None
        # The step's forward without transformers' module stack (the same ops: decode_forward.py); None keeps the
        # model's own forward (a decoder it does not know, or ``lean_forward=False``).
        lang = lm.adapter.language_model(lm.model)
        self.forward = DecodeForward.shared(lang, lm.model.lm_head) if lean_forward else None
        self.lm = lm
        self.pool = pool
        self.max_batch = max_batch
        self.clock = clock
        self.prefer_contiguous = prefer_contiguous
        self.last_error: BaseException | None = None
        self.failed_steps = 0
        """Steps failed in a row (a step that worked resets it): the decode stage's health."""
        self.replayed = 0
        """Tokens fed through replay steps (decode migration)."""
        self.replay_mismatches = 0
        """Replayed tokens that this engine would have sampled differently (0 when a rebuild is exact)."""
        self._pending: OrderedDict[str, tuple[PrefillOutput, SamplingParams, float | None, tuple[int, ...]]] = (
            OrderedDict()
        )
        self._running: OrderedDict[tuple[str, int], RunningSequence] = OrderedDict()
        """Sequences by (request id, choice index)."""
        self._live: Counter[str] = Counter()
        """Running sequences per request: its lease goes back when the last one ends."""
        self._events: list[TokenEvent] = []
        self._landing: dict[str, tuple[SamplingParams, tuple[int, ...]]] = {}
        """Sequences :meth:`claim` gave blocks whose KV is on its way into them (not yet started: :meth:`start`)."""
        self._reserved: dict[str, float | None] = {}
        """Reservations not yet claimed by a submit (granted or waiting in the pool's queue) → their deadline."""
        self.masks = StepMasks(max_batch)
        """The steps' grammar masks and their cost (its ``seconds``, ``rows`` and ``steps``)."""

    # ---- a sequence's tokens: its start, each token it emits or replays --------------------------------------------
    def _begin(
        self,
        request_id: str,
        lease: Lease,
        pre: Prefilled,
        sampling: SamplingParams,
        deadline: float | None,
        replay: tuple[int, ...],
    ) -> None:
        try:
            matchers = [self._matcher(sampling) for _ in range(sampling.n)]  # (one compile: the others are cached)
        except Exception:  # (checked at submit; a recompile after eviction failing here ends this sequence alone:
            # _begin may run inside another sequence's release)
            log.exception("grammar of %s did not compile at admission", request_id)
            self._events.append(TokenEvent(request_id, None, "error"))
            self._release(request_id)
            return
        seq = self._sequence(request_id, 0, lease, list(lease.blocks), pre, sampling, deadline, matchers[0])
        forks = [
            self._sequence(request_id, i, lease, self._fork(lease, pre, sampling), pre, sampling, deadline, matchers[i])
            for i in range(1, sampling.n)
        ]
        if not replay:
            self._emit(seq, pre.first_token_id, pre.first_logprob)
            for fork, first in zip(forks, pre.forks, strict=True):
                if request_id in self._live:  # (not if an earlier choice's grammar failed: that ends them all)
                    fork.last_token = first.token_id
                    self._emit(fork, first.token_id, first.logprob)
            return
        seq.forced.extend(replay)
        self._replay(seq, pre.first_token_id)

    def _sequence(
        self,
        request_id: str,
        index: int,
        lease: Lease,
        table: list[int],
        pre: Prefilled,
        sampling: SamplingParams,
        deadline: float | None,
        matcher: llguidance.LLMatcher | None,
    ) -> RunningSequence:
        """Choice ``index``'s running sequence."""
        own = sampling.for_choice(index)
        seq = RunningSequence(
            request_id=request_id,
            sampling=own,
            lease=lease,
            table=table,
            rope_delta=pre.rope_delta,
            length=pre.layout.num_tokens,
            last_token=pre.first_token_id,
            step=0,
            stops=StopChecker(self.lm, own),
            deadline=deadline,
            matcher=matcher,
            index=index,
        )
        self._running[seq.key] = seq
        self._live[request_id] += 1
        return seq

    def _matcher(self, sampling: SamplingParams) -> llguidance.LLMatcher | None:
        if sampling.guide is None:
            return None
        return compiler_for(self.lm).matcher(sampling.guide)

    def _advance(self, seq: RunningSequence, token: int) -> bool:
        """Feed ``token`` to the sequence's grammar; False (the sequence is aborted) if the grammar refuses it or has
        failed (a parser limit met at a step: its mask then allows only EOS, which must not end a reply as ``stop``)."""
        if seq.matcher is None or (seq.matcher.consume_token(token) and not seq.matcher.is_error()):
            return True
        error = seq.matcher.get_error()[:200]
        log.error("grammar of %s failed at step %d (token %d): %s", seq.request_id, seq.step, token, error)
        self._abort(seq.request_id, "error")
        return False

    def _emit(self, seq: RunningSequence, token: int, logprob: TokenLogprob | None = None) -> None:
        if not self._advance(seq, token):
            return
        if seq.sampling.penalised:
            seq.counts[token] += 1
        reason = seq.stops.check(token, seq.step + 1)
        if reason in (None, "length") and seq.matcher is not None and seq.matcher.is_stopped():
            reason = "stop"  # the grammar is complete (at max_tokens too): nothing may follow
        self._events.append(TokenEvent(seq.request_id, token, reason, logprob, seq.index))
        if reason is not None:
            del self._running[seq.key]
            self._live[seq.request_id] -= 1
            if not self._live[seq.request_id]:  # (its last choice: the request's lease goes back)
                del self._live[seq.request_id]
                self._release(seq.request_id)

    def _replay(self, seq: RunningSequence, sampled: int) -> None:
        """Take the next forced token in place of ``sampled``: the state advances as :meth:`_emit` would advance
        it, but nothing is emitted (the client has the token already)."""
        token = seq.forced.popleft()
        seq.last_token = token
        self.replayed += 1
        if token != sampled:
            self.replay_mismatches += 1
            if not seq.diverged:  # once per sequence: after a divergence every later step may differ too
                seq.diverged = True
                log.warning(
                    "replay of %s diverged at step %d: %d sent, %d resampled", seq.request_id, seq.step, token, sampled
                )
        if not self._advance(seq, token):
            return
        if seq.sampling.penalised:
            seq.counts[token] += 1
        if seq.stops.check(token, seq.step + 1) is not None:  # a received token cannot have finished the stream
            self._abort(seq.request_id, "error")

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One forward pass over up to ``max_batch`` running sequences; returns every token produced since the
        last call (first tokens of newly admitted sequences included)."""
        self._expire()
        batch = list(self._running.values())[: self.max_batch]
        if batch:
            try:
                self._decode(batch)
                self.failed_steps = 0
            except Exception as exc:  # a failed step must not leak KV or hang its sequences
                log.exception("decode step over %d sequences failed; they end with an error event", len(batch))
                self.last_error = exc
                self.failed_steps += 1
                for seq in batch:
                    self._abort(seq.request_id, "error")
            # Rotate so sequences beyond max_batch get their turn next step.
            for seq in batch:
                if seq.key in self._running:
                    self._running.move_to_end(seq.key)
        return self.take_events()

    def take_events(self) -> list[TokenEvent]:
        """Every event produced since the last call, without a forward pass: a sequence's first token is known
        when it starts (prefill sampled it), so its caller need not wait for the next step to see it."""
        events, self._events = self._events, []
        return events

    def _expire(self) -> None:
        now = self.clock()
        self.expire_waiting()
        late = {seq.request_id for seq in self._running.values() if seq.deadline is not None and seq.deadline <= now}
        for rid in late:
            self._abort(rid, "timeout")

    def expire_waiting(self) -> None:
        """Time out the sequences waiting for their lease whose deadline passed (each a ``timeout`` event, returned
        by the next :meth:`step`) — :meth:`step` does it too, but with nothing running nobody steps."""
        now = self.clock()
        for rid in [rid for rid, (_, _, dl, _) in self._pending.items() if dl is not None and dl <= now]:
            self._abort(rid, "timeout")

    def _abort(self, request_id: str, reason: EngineFinish) -> None:
        known = self._pending.pop(request_id, None) is not None
        known = self._drop_running(request_id) or known
        if known:
            self._events.append(TokenEvent(request_id, None, reason))
            self._release(request_id)

    def _decode(self, batch: list[RunningSequence]) -> None:
        for seq in batch:
            if seq.length == len(seq.table) * self.pool.block_size:
                seq.table.extend(self.pool.allocate(seq.lease, 1))
        logits, raw = step_logits(self.lm, self.forward, self.pool, self.kernel, batch)
        self.masks.apply(batch, logits)
        # (one argmax for all the plain greedy rows: the same ids as each row's own)
        plain = [plain_greedy(seq.sampling, seq.counts) for seq in batch]
        argmax = logits.argmax(-1).tolist() if any(plain) else []
        for i, seq in enumerate(batch):
            if seq.key not in self._running:  # (another choice of its request aborted them all in this loop)
                continue
            seq.length += 1
            seq.step += 1
            sampled = argmax[i] if plain[i] else sample_token(logits[i], seq.sampling, seq.step, seq.counts)
            if seq.forced:
                self._replay(seq, sampled)
            else:
                seq.last_token = sampled
                row = raw.get(i)
                self._emit(
                    seq, sampled, None if row is None else token_logprob(row, sampled, seq.sampling.logprobs or 0)
                )
