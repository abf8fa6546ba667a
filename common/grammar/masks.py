"""Token masks for a batched step: filled for every constrained sequence at once, applied to their logits rows.

A mask is llguidance's bitmask (one bit per token id, 32 per ``int32`` word). :class:`MaskBuffer` keeps one
``[max_batch, words]`` buffer per engine, so a step allocates nothing; :meth:`MaskBuffer.fill` fills the rows of the
constrained sequences on the library's thread pool (the GIL is released while it works); :func:`apply_masks` sets the
disallowed logits of exactly those rows to -1e30 (allowed ones keep their values exactly) — an unconstrained row is
never read or written, so a sequence's tokens do not depend on its neighbours' grammars.

:func:`apply_masks` runs in C (``masks.c``, built on first use like the other kernels: :mod:`common.native_build`):
one call for the batch, rows over PyTorch's threads, a word of the mask at a time (all allowed: skipped; all refused:
one store). At a 151k-token vocabulary and 32 rows it took 0.4 ms a step where the numpy paths beside it took
1.2–2.1 ms (``loadtest/bench_grammar.py``'s masks, 2-core AMD EPYC Zen 4). Where it cannot be built (no compiler,
``PRISM_NATIVE_MASKS=0``), or for tensors it does not take (another dtype or device, logits not ``[rows, vocab]``
with contiguous rows, masks not contiguous ``int32``, a row index outside the logits), those paths run: the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import llguidance
import numpy as np
import torch

from common.native_build import load_optional


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
            if self._executor is None:  # (threads as many as this process may use, at most 8: the library's default
                # of 80 % of the machine's CPUs left masks slower on a 2-core replica)
                self._executor = llguidance.LLExecutor(num_threads=min(8, len(os.sched_getaffinity(0))))
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], rows.data_ptr(), self.words * 4, len(matchers)
            )
        return rows


REFUSED = -1e30
"""A refused token's logit: no softmax, top-p or argmax can pick it (float16's lowest value where -1e30 is out of its
range)."""
_BIT = np.arange(32, dtype=np.int32)
DENSE_VOCAB = 32_768
"""Up to this vocabulary a batch's masks are applied in one vectorised pass; above it, row by row, sparsely."""


def _tokens(words: np.ndarray, where: np.ndarray, allowed: bool) -> np.ndarray:
    """Token ids whose bit is 1 (``allowed``) or 0 in the words at positions ``where`` of one row's mask."""
    bits = (words[where, None] >> _BIT) & 1
    w, j = np.nonzero(bits if allowed else bits == 0)
    return where[w] * 32 + j


SOURCE = Path(__file__).with_name("masks.c")
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
"""The logits dtypes the C kernel takes, each with the integer type of its width (it moves bit patterns)."""


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    built = load_optional(SOURCE, "PRISM_NATIVE_MASKS", "the C mask kernel", "masks are applied through numpy")
    if built is None:
        return None
    lib = built[0]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn, pattern in ((lib.apply_masks_32, ctypes.c_uint32), (lib.apply_masks_16, ctypes.c_uint16)):
        fn.restype = None
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, pattern, ctypes.c_int]
    return lib


def warm() -> bool:
    """Build (or load) the C kernel now — an engine's start, not its first constrained step; whether it is there."""
    return _kernel() is not None


@functools.cache
def _pattern(dtype: torch.dtype, value: float) -> int:
    """``value`` in ``dtype`` as the unsigned bit pattern the kernel stores (once per dtype, not per step)."""
    bits = _BITS[dtype]
    return torch.tensor([value], dtype=dtype).view(bits).item() & (0xFFFFFFFF if bits == torch.int32 else 0xFFFF)


def _apply_in_c(logits: torch.Tensor, rows: list[int], masks: torch.Tensor, refused_value: float) -> bool:
    """:func:`apply_masks` through ``masks.c``; ``False`` (nothing written) where the kernel or these tensors will not
    do."""
    lib, bits = _kernel(), _BITS.get(logits.dtype)
    if lib is None or bits is None or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1:
        return False
    if masks.dtype != torch.int32 or masks.device.type != "cpu" or not masks.is_contiguous():
        return False
    vocab, words = logits.shape[-1], masks.shape[1]
    # (C writes where it is told: rows outside the logits, or rows that overlap, go to numpy, which checks)
    if masks.shape[0] < len(rows) or logits.stride(0) < vocab or len(set(rows)) < len(rows):
        return False
    if not all(0 <= r < logits.shape[0] for r in rows):
        return False
    fn = lib.apply_masks_32 if bits == torch.int32 else lib.apply_masks_16
    at = np.asarray(rows, np.int64)
    fn(
        logits.data_ptr(),
        logits.stride(0),
        at.ctypes.data,
        at.size,
        masks.data_ptr(),
        words,
        vocab,
        _pattern(logits.dtype, refused_value),
        torch.get_num_threads(),
    )
    return True


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Constrain, in place, ``logits[rows[i]]`` by ``masks[i]`` (other rows untouched): in C where it can
    (:func:`_apply_in_c`); otherwise work follows the smaller of the allowed and refused sets, not the vocabulary:
    inside a JSON string nearly every token is allowed and only the few refused ones are written; between values a
    handful is allowed, so the row is filled and those few put back (a masked fill of 32 × 151k logits costs 4–18 ms
    here, this ≈ 3 ms). Up to :data:`DENSE_VOCAB` tokens, one masked fill over the rows (the loop's per-row cost
    would dominate)."""
    vocab = logits.shape[-1]
    if masks.shape[1] * 32 < vocab:
        raise ValueError(f"masks of {masks.shape[1]} words cover {masks.shape[1] * 32} tokens, the logits {vocab}")
    refused_value = max(REFUSED, torch.finfo(logits.dtype).min)
    if _apply_in_c(logits, rows, masks, refused_value):
        return
    words = masks.numpy()
    if vocab <= DENSE_VOCAB:  # small rows: one vectorised pass beats a Python loop over the rows
        refused = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little") == 0
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(torch.from_numpy(refused), refused_value)
        else:
            index = torch.tensor(rows)
            logits[index] = logits[index].masked_fill(torch.from_numpy(refused), refused_value)
        return
    allowed_counts = np.bitwise_count(words.view(np.uint32)).sum(axis=1)
    for i, row in enumerate(rows):
        target = logits[row]
        mask = words[i]
        if allowed_counts[i] >= vocab - allowed_counts[i]:  # mostly allowed: write the refused ones
            refused = _tokens(mask, np.flatnonzero(mask != -1), allowed=False)
            target[torch.from_numpy(refused[refused < vocab])] = refused_value
        else:  # mostly refused: keep the allowed ones' values, fill the rest
            keep = _tokens(mask, np.flatnonzero(mask), allowed=True)
            keep = torch.from_numpy(keep[keep < vocab])
            values = target[keep].clone()
            target.fill_(refused_value)
            target[keep] = values


def mask_row(logits: torch.Tensor, matcher: llguidance.LLMatcher, buffer: MaskBuffer) -> None:
    """Apply one matcher's mask to one ``[vocab]`` logits row in place (prefill's first token, the reference path)."""
    apply_masks(logits[None], [0], buffer.fill([matcher]))
