"""Builds the :class:`PagedContext` of one batched decode step from the sequences' block tables."""

from __future__ import annotations

import torch

from common.kv.paged_attention import PagedContext
from common.kv.pool import KVPool


def build_step_context(pool: KVPool, tables: list[list[int]], lengths: torch.Tensor) -> PagedContext:
    """``lengths[i]`` tokens already cached for sequence i; this step writes token ``lengths[i]``."""
    bs = pool.block_size
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
    write_blocks = padded[torch.arange(len(tables)), lengths // bs]
    slots = torch.arange(width * bs)
    mask = (slots[None, :] <= lengths[:, None]).view(len(tables), 1, 1, width * bs)
    return PagedContext(pool=pool, write_blocks=write_blocks, write_offsets=lengths % bs, tables=padded, mask=mask)
