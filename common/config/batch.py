"""``batch:`` — the offline video batch job's Ray Data stage sizes and output cadence."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Strict


class BatchConfig(Strict):
    """The offline video batch job (``python -m services.batch``): Ray Data stage sizes and output cadence."""

    media_concurrency: int = Field(default=2, ge=1)
    """CPU tasks fetching, decoding and processing clips at once."""
    media_num_cpus: float = Field(default=0.5, gt=0)
    """CPUs per media task."""
    encode_actors: int = Field(default=1, ge=1)
    """Encode actors (each holds the vision tower)."""
    encode_batch_size: int = Field(default=4, ge=1)
    """Clips per encode call (one vision-tower batch)."""
    encode_num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per encode actor."""
    generate_actors: int = Field(default=1, ge=1)
    """Prefill + decode actors (each holds the language model and a KV pool)."""
    generate_batch_size: int = Field(default=8, ge=1)
    """Clips decoded together (continuous batching within the batch)."""
    generate_num_gpus: float = Field(default=0.0, ge=0)
    """GPUs per generate actor."""
    actor_num_cpus: float = Field(default=0.5, gt=0)
    """CPUs per encode / generate actor (actors hold theirs for the whole job: media tasks need room beside them)."""
    default_max_tokens: int = Field(default=128, ge=1)
    """Output tokens for rows without ``max_tokens``."""
    model: str | None = None
    """With several ``models:``, the one (its served name) the batch job runs; ``None``: the first that takes video."""
    write_every_rows: int = Field(default=16, ge=1)
    """Rows per output part file: a killed job loses at most this many finished rows plus those in flight."""
    progress_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between progress lines (one is also written with every part)."""
