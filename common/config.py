"""Pydantic configuration for Prism's core.

Every field has a docstring; unknown fields are refused (``extra="forbid"``), so a typo in a YAML file is an error
at load time, not a silently ignored setting. Nothing here reads the environment at import; callers load a config
explicitly (``PrismConfig.model_validate(yaml_dict)``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.media.config import MediaConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Which model to serve and how to load it."""

    model: str = "prism-tiny-llava"
    """An embedded model name (``prism-tiny-llava``, ``prism-tiny-qwen2vl``, ``prism-small-*``) or a local HF
    checkpoint directory of a supported family."""
    served_name: str | None = None
    """Name clients use in the ``model`` field; defaults to ``model`` (or the directory's name)."""
    cache_dir: str = "~/.cache/prism/models"
    """Where embedded models are built on first use."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/activation dtype; ``auto`` takes the checkpoint's own dtype."""
    torch_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads for this process; set it to the replica's CPU share so replicas don't fight."""


class EngineConfig(_Strict):
    """Stage-level settings shared by prefill and decode."""

    kv_block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block; KV travels from prefill to decode in blocks of this size."""
    max_prompt_tokens: int = Field(default=4096, ge=1)
    """Prompts longer than this (after placeholder expansion) are refused with a 400."""
    max_output_tokens: int = Field(default=1024, ge=1)
    """Upper bound on a request's ``max_tokens``."""


class PrismConfig(_Strict):
    """Top-level configuration."""

    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    media: MediaConfig = Field(default_factory=MediaConfig)
