"""Token masks for a batched step: filled for every constrained sequence at once, applied to their logits rows.

A mask is llguidance's bitmask (one bit per token id, 32 per ``int32`` word). :class:`MaskBuffer` keeps one
``[max_batch, words]`` buffer per engine, so a step allocates nothing; :func:`fill_masks` fills the rows of the
constrained sequences on the library's thread pool (the GIL is released while it works); :func:`apply_masks` sets the
disallowed logits of exactly those rows to ``-inf`` — an unconstrained row is never read or written, so a
sequence's tokens do not depend on its neighbours' grammars.
"""

from __future__ import annotations

import llguidance
import torch

_BITS = torch.arange(32, dtype=torch.int32)


class MaskBuffer:
    def __init__(self, vocab_size: int, rows: int = 1) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.buffer = torch.full((rows, self.words), -1, dtype=torch.int32)
        self._executor: llguidance.LLExecutor | None = None

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The masks of ``matchers``' next tokens, row i for matcher i (a view into the buffer, valid until the next
        call)."""
        if len(matchers) > self.buffer.shape[0]:
            self.buffer = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        rows = self.buffer[: len(matchers)]
        if len(matchers) == 1:  # (no thread hop for one)
            matchers[0].unsafe_compute_mask_ptr(rows.data_ptr(), self.words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], rows.data_ptr(), self.words * 4, len(matchers)
            )
        return rows


def allowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` bitmasks → ``[rows, vocab_size]`` booleans (True: the token may come next)."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set, in place, the disallowed entries of ``logits[rows[i]]`` to ``-inf`` under ``masks[i]``."""
    index = torch.tensor(rows, dtype=torch.long)
    keep = allowed(masks, logits.shape[-1])
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def mask_row(logits: torch.Tensor, matcher: llguidance.LLMatcher, buffer: MaskBuffer) -> None:
    """Apply one matcher's mask to one ``[vocab]`` logits row in place (prefill's first token, the reference path)."""
    apply_masks(logits[None], [0], buffer.fill([matcher]))
