"""Hand-off memory starts on a page: arenas and KV pools line up, so copies between them run at full speed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.kv import aligned
from common.kv.pool import KVPool
from common.kv.transport.arena import ALIGN, Arena


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 5 << 20])
def test_zeros_start_on_a_page_and_are_zero(nbytes):
    a = aligned.zeros(nbytes)
    assert a.dtype == np.uint8 and a.shape == (nbytes,) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % aligned.PAGE == 0 and not a.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pools_keys_and_values_start_on_a_page_zeroed_and_writable(dtype):
    pool = KVPool(6, 16, (3, 2, 64), dtype)
    for t in (pool.keys, pool.values):
        assert t.shape == (3, 6, 16, 2, 64) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % aligned.PAGE == 0 and not t.any()
    assert pool.keys.data_ptr() != pool.values.data_ptr()
    pool.keys[1, 2] = 1.5  # (writes land where the hand-off's numpy views see them)
    keys, _ = pool.arrays()
    assert keys.ctypes.data == pool.keys.data_ptr() and keys[1, 2].any() and not keys[0].any()


def test_an_arenas_slots_start_on_pages():
    arena = Arena(3 * ALIGN + 10)
    assert arena.address % aligned.PAGE == 0
    offsets = [arena.alloc(n) for n in (10, ALIGN + 1, 1)]
    assert all(o is not None and (arena.address + o) % aligned.PAGE == 0 for o in offsets)
