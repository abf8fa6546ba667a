"""Builds the :class:`PagedContext` of one batched decode step from the sequences' block tables."""

from __future__ import annotations

import torch

from common.kv.native import DecodeKernel
from common.kv.paged_attention import PagedContext
from common.kv.pool import KVPool


def is_run(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def _padded(tables: list[list[int]], width: int) -> torch.Tensor:
    """``[len(tables), width]`` block ids, each table padded with its own first block (a valid id, never read)."""
    return torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)


def build_step_context(
    pool: KVPool, tables: list[list[int]], lengths: list[int], kernel: DecodeKernel | None = None
) -> PagedContext:
    """``lengths[i]`` tokens already cached for sequence i; this step writes token ``lengths[i]``. With a ``kernel``
    the context also holds every sequence's block table for it (the PyTorch path's fields stay: its fallback)."""
    bs = pool.block_size
    length = torch.tensor(lengths)
    write_blocks = torch.tensor([t[n // bs] for t, n in zip(tables, lengths, strict=True)])
    runs = [t[0] if is_run(t) else None for t in tables]
    scattered = [i for i, r in enumerate(runs) if r is None]
    width = max((len(tables[i]) for i in scattered), default=1)
    padded = _padded([tables[i] for i in scattered], width)
    slots = torch.arange(width * bs)
    mask = (slots[None, :] <= length[scattered][:, None]).view(len(scattered), 1, 1, width * bs)
    block_tables = _padded(tables, max(len(t) for t in tables)) if kernel is not None else None
    return PagedContext(
        pool=pool,
        write_blocks=write_blocks,
        write_offsets=length % bs,
        lengths=list(lengths),
        runs=runs,
        scattered=torch.tensor(scattered, dtype=torch.long),
        tables=padded,
        mask=mask,
        kernel=kernel,
        block_tables=block_tables,
        attend_lengths=length + 1 if kernel is not None else None,
    )
