"""Applying token bitmasks: the same logits as a plain masked fill, for masks mostly allowed, mostly refused and random,
on a subset of rows, with a vocabulary that is not a multiple of 32; other rows untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.grammar import masks as masks_module
from common.grammar.masks import REFUSED, apply_masks


def _naive(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    refused = max(REFUSED, torch.finfo(logits.dtype).min)  # (float16 cannot hold -1e30)
    for i, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if not (int(masks[i, token // 32]) >> (token % 32)) & 1:
                out[row, token] = refused
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dense", [True, False])
def test_apply_masks_equals_a_plain_masked_fill(dtype, dense, monkeypatch):
    monkeypatch.setattr(masks_module, "DENSE_VOCAB", 10**6 if dense else 0)
    rng = np.random.default_rng(0)
    vocab, words = 1000, 32  # (1000 is not a multiple of 32: the last word's high bits are padding)
    masks = np.full((4, words), -1, dtype=np.int32)
    masks[0, 3] = 0x0F0F0F0F  # mostly allowed, a few refused
    masks[0, 31] = 0  # padding and the last tokens refused
    masks[1] = 0
    masks[1, 5] = 1 << 7  # mostly refused: one token allowed
    masks[1, 9] = -(1 << 31)  # bit 31 alone
    masks[1, 31] = -1  # padding bits set (the library clears them; this must not index past the vocabulary)
    masks[2] = rng.integers(-(2**31), 2**31, size=words, dtype=np.int64).astype(np.int32)  # random
    masks[3] = 0
    masks[3, :10] = -1  # half and half-ish
    logits = torch.randn(6, vocab).to(dtype)
    rows = [5, 0, 2, 3]
    want = _naive(logits, rows, torch.from_numpy(masks))
    got = logits.clone()
    apply_masks(got, rows, torch.from_numpy(masks))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a grammar: untouched
