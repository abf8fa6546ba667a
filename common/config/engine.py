"""``engine:`` — settings of the encode, prefill and decode engines."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Strict


class EngineConfig(Strict):
    """Engine settings of the encode, prefill and decode stages."""

    kv_block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block; KV travels from prefill to decode in blocks of this size."""
    max_prompt_tokens: int = Field(default=4096, ge=1)
    """Prompts longer than this (after placeholder expansion) are refused with a 400."""
    max_output_tokens: int = Field(default=1024, ge=1)
    """Upper bound on a request's ``max_tokens``."""
    kv_pool_blocks: int = Field(default=2048, ge=1)
    """KV blocks in each decode replica's pool."""
    max_lease_fraction: float = Field(default=0.5, gt=0, le=1)
    """Largest share of the pool one request may lease."""
    max_batch: int = Field(default=32, ge=1)
    """Sequences decoded per step."""
    prefill_chunk_tokens: int = Field(default=512, ge=1)
    """Prompt tokens computed per prefill step (a media span is kept whole where the model family asks for it)."""
    prefix_cache_blocks: int = Field(default=1024, ge=0)
    """KV blocks the prefill stage keeps for its prefix cache (0 disables it)."""
    encoder_cache_bytes: int = Field(default=256 << 20, ge=0)
    """Bytes of visual embeddings the encode stage caches (0 disables it)."""
    processor_cache_bytes: int = Field(default=512 << 20, ge=0)
    """Bytes of processed pixel arrays the media stage caches (0 disables it)."""
    encoder_patch_budget: int = Field(default=16_384, ge=1)
    """Vision patches per encoder batch."""
    shared_cache_scope: bool = False
    """Share processor/encoder/prefix caches across tenants (only for single-tenant deployments)."""

    @property
    def max_lease_blocks(self) -> int:
        """KV blocks one request may lease in a decode pool (what :class:`common.kv.pool.KVPool` allows)."""
        return max(1, int(self.kv_pool_blocks * self.max_lease_fraction))
