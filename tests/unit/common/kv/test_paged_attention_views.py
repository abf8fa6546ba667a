"""The one-call view of a sequence's contiguous run of pool blocks is the very view the indexing chain makes: same
memory, sizes and strides — so the attention kernel sees identical inputs and decode stays token-exact."""

from __future__ import annotations

import pytest
import torch

from common.kv.paged_attention import run_view


def _chain(store: torch.Tensor, layer: int, start: int, n: int) -> torch.Tensor:
    heads, dim, bs = store.shape[3], store.shape[4], store.shape[2]
    return store[layer, start : start + -(-n // bs)].view(-1, heads, dim)[:n].transpose(0, 1)[None]


@pytest.mark.parametrize(("layer", "start", "n"), [(0, 0, 1), (1, 3, 16), (2, 5, 17), (3, 0, 80), (2, 9, 7)])
def test_run_view_is_the_indexing_chains_view(layer, start, n):
    store = torch.randn(4, 16, 16, 2, 8)  # layers, blocks, block size, kv heads, head dim
    fast, slow = run_view(store, layer, start, n), _chain(store, layer, start, n)
    assert fast.shape == slow.shape == (1, 2, n, 8)
    assert fast.stride() == slow.stride() and fast.data_ptr() == slow.data_ptr()
    assert torch.equal(fast, slow)


def test_run_view_of_a_store_that_is_itself_a_view():
    base = torch.randn(2, 4, 16, 16, 2, 8)
    store = base[1]  # a pool store living at an offset of a larger tensor
    assert torch.equal(run_view(store, 3, 2, 20), _chain(store, 3, 2, 20))
