"""Builds the :class:`PagedContext` of one batched decode step from the sequences' block tables."""

from __future__ import annotations

import torch

from common.kv.native import DecodeKernel
from common.kv.paged_attention import PagedContext, padded_tables
from common.kv.pool import KVPool


def build_step_context(
    pool: KVPool, tables: list[list[int]], lengths: list[int], kernel: DecodeKernel | None = None
) -> PagedContext:
    """``lengths[i]`` tokens already cached for sequence i; this step writes token ``lengths[i]``. With a ``kernel``
    the context also holds every sequence's block table for it (the PyTorch path's plan, its fallback, is made only
    if a layer takes that path: :attr:`PagedContext.gather`)."""
    bs = pool.block_size
    length = torch.tensor(lengths)
    write_blocks = torch.tensor([t[n // bs] for t, n in zip(tables, lengths, strict=True)])
    block_tables = padded_tables(tables, max(len(t) for t in tables)) if kernel is not None else None
    return PagedContext(
        pool=pool,
        write_blocks=write_blocks,
        write_offsets=length % bs,
        lengths=list(lengths),
        block_lists=tables,
        kernel=kernel,
        block_tables=block_tables,
        attend_lengths=length + 1 if kernel is not None else None,
    )
