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
@pytest.mark.parametrize("path", ["c", "dense", "sparse"])
def test_apply_masks_equals_a_plain_masked_fill(dtype, path, monkeypatch):
    if path == "c" and not masks_module.warm():
        pytest.skip("no C compiler here: the numpy paths are what runs")
    if path != "c":
        monkeypatch.setattr(masks_module, "_kernel", lambda: None)
    monkeypatch.setattr(masks_module, "DENSE_VOCAB", 10**6 if path == "dense" else 0)
    calls = []
    apply_in_c = masks_module._apply_in_c
    monkeypatch.setattr(masks_module, "_apply_in_c", lambda *a: calls.append(apply_in_c(*a)) or calls[-1])
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
    assert calls == [path == "c"]  # (the path under test is the one that ran)


def test_logits_the_c_kernel_does_not_take_go_through_numpy_and_short_masks_are_refused():
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 0b101  # tokens 0 and 2 allowed
    wide = torch.randn(2, 128)
    strided = wide[:, ::2]  # (rows of 64 that are not contiguous: numpy's path)
    want = _naive(strided, [0, 1], masks)
    assert not masks_module._apply_in_c(strided, [0, 1], masks, REFUSED)
    apply_masks(strided, [0, 1], masks)
    assert torch.equal(strided, want)
    with pytest.raises(ValueError, match="cover 64 tokens, the logits 65"):  # (every path)
        apply_masks(torch.randn(2, 65), [0, 1], masks)


def test_rows_outside_the_logits_or_repeated_never_reach_the_c_kernel():
    masks = torch.zeros(2, 2, dtype=torch.int32)
    parent = torch.randn(4, 64)
    before = parent.clone()
    for rows in ([3], [-1], [0, 0]):
        assert not masks_module._apply_in_c(parent[:2], rows, masks, REFUSED)
    with pytest.raises(IndexError):  # (numpy's path checks the index: nothing past the view is written)
        apply_masks(parent[:2], [3], masks)
    assert torch.equal(parent[2:], before[2:])
