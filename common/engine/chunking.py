"""Prefill chunk planning that respects media spans.

A chunk boundary may not fall strictly inside a media item's placeholder span unless the family says its attention
allows it: the boundary moves back to the span's start, or — when the span starts the chunk, i.e. the span is longer
than a chunk — forward to its end, so one image's embeddings are always computed in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.protocol.handoff import PlaceholderSpan


def inside_span(pos: int, spans: Sequence[PlaceholderSpan]) -> PlaceholderSpan | None:
    """The span that ``pos`` cuts (start < pos < end), if any."""
    for span in spans:
        if span.prompt_token_start < pos < span.end:
            return span
    return None


def next_chunk_end(start: int, n_tokens: int, budget: int, spans: Sequence[PlaceholderSpan], allow_split: bool) -> int:
    end = min(start + max(1, budget), n_tokens)
    span = None if allow_split else inside_span(end, spans)
    if span is not None:
        end = span.prompt_token_start if span.prompt_token_start > start else span.end
    return end


def plan_chunks(
    n_tokens: int, spans: Sequence[PlaceholderSpan], chunk_tokens: int, start: int = 0, allow_split: bool = False
) -> list[tuple[int, int]]:
    chunks = []
    while start < n_tokens:
        end = next_chunk_end(start, n_tokens, chunk_tokens, spans, allow_split)
        chunks.append((start, end))
        start = end
    return chunks


def usable_prefix_blocks(hit_blocks: int, block_size: int, spans: Sequence[PlaceholderSpan], allow_split: bool) -> int:
    """Trim a prefix-cache hit so that the recomputed part does not start inside a media span."""
    while hit_blocks > 0 and not allow_split and inside_span(hit_blocks * block_size, spans) is not None:
        hit_blocks -= 1
    return hit_blocks
