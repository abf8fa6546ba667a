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
    the context also holds every sequence's block table for it (the PyTorch path's plan and writes, its fallback, are
    made only if a layer takes that path: :attr:`PagedContext.gather`, ``write_blocks``)."""
    if kernel is None:
        return PagedContext(pool=pool, lengths=list(lengths), block_lists=tables)
    return PagedContext(
        pool=pool,
        lengths=list(lengths),
        block_lists=tables,
        kernel=kernel,
        block_tables=padded_tables(tables, max(len(t) for t in tables)),
        attend_lengths=torch.tensor([n + 1 for n in lengths]),
    )
