"""One decode step's logits: the batch's forward pass, the raw distributions its sequences ask for, the grammar masks.

:func:`step_logits` runs every sequence of the batch one position on, each over its own block table (the paged
context: :mod:`common.engine.paged_step`), through the lean forward when the engine has one
(:mod:`common.engine.decode_forward`) or the model's own, then the LM head on the last position. The rows of the
sequences that report log-probabilities (and are not replaying) get their raw distribution taken there, before any
mask: what the model said, not what the grammar allowed. :class:`StepMasks` then constrains the rows of the guided
sequences in place, all of them at once (:mod:`common.grammar.masks`), and counts what that cost — the
structured-output overhead the decode stage exports as metrics. The engine samples from what is left.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common.engine.decode_forward import DecodeForward
from common.engine.paged_step import build_step_context
from common.engine.sequence import RunningSequence
from common.grammar.masks import MaskBuffer, apply_masks
from common.grammar.masks import warm as warm_masks
from common.kv.native import DecodeKernel
from common.kv.pool import KVPool
from common.model.loader import LoadedModel
from common.stages.sampler import log_probs


def step_logits(
    lm: LoadedModel,
    forward: DecodeForward | None,
    pool: KVPool,
    kernel: DecodeKernel | None,
    batch: list[RunningSequence],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``[len(batch), vocab]`` next-token logits (each sequence's new KV written to its pool slot on the way), and
    the raw log-probabilities of the rows that ask for them, by row. Every sequence's table must already hold the
    block its new token goes to."""
    lengths = [s.length for s in batch]
    ctx = build_step_context(pool, [s.table for s in batch], lengths, kernel)
    input_ids = torch.tensor([[s.last_token] for s in batch])
    positions = lm.adapter.decode_positions(torch.tensor(lengths), torch.tensor([s.rope_delta for s in batch]))
    with torch.inference_mode():
        if forward is not None:
            logits = forward.logits(input_ids, positions, ctx, lm.model.lm_head)
        else:
            lang: Any = lm.adapter.language_model(lm.model)
            hidden = lang(input_ids=input_ids, position_ids=positions, use_cache=False, prism_paged=ctx)
            logits = lm.model.lm_head(hidden.last_hidden_state[:, -1:, :])[:, -1]
        # (the raw distribution, before the grammar's mask; only the rows that report it, not replaying: one pass)
        asking = [i for i, s in enumerate(batch) if s.sampling.logprobs is not None and not s.forced]
        raw = dict(zip(asking, log_probs(logits[asking]), strict=True)) if asking else {}
    return logits, raw


class StepMasks:
    """The grammar masks of an engine's steps: one buffer for up to ``max_batch`` rows, and their cost."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._buffer: MaskBuffer | None = None
        warm_masks()  # (the C kernel built with the engine, not on its first constrained step)
        self.seconds = 0.0
        """Spent filling and applying masks (the structured-output overhead of the steps)."""
        self.rows = 0
        """Logits rows masked (one per constrained sequence per step)."""
        self.steps = 0
        """Steps with at least one constrained sequence."""

    def apply(self, batch: list[RunningSequence], logits: torch.Tensor) -> None:
        """Constrain the logits rows of the batch's guided sequences (in place; other rows untouched)."""
        rows = [i for i, seq in enumerate(batch) if seq.matcher is not None]
        if not rows:
            return
        started = time.perf_counter()
        if self._buffer is None:
            self._buffer = MaskBuffer(logits.shape[-1], self.max_batch)
        with torch.inference_mode():  # (the logits are inference tensors: changed in place only in that mode)
            apply_masks(logits, rows, self._buffer.fill([batch[i].matcher for i in rows]))
        self.seconds += time.perf_counter() - started
        self.rows += len(rows)
        self.steps += 1
