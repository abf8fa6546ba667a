"""A request's resource vector, and admission against per-request limits and in-flight budgets.

Prompt length alone says little about a VLM request's cost: one 4K image is thousands of vision patches and visual
tokens behind a ten-word prompt. Every request is therefore measured as a vector (media bytes, pixels, frames,
patches, visual tokens, text tokens, max output tokens, KV blocks) once its media are processed, and:

* each component is checked against its **per-request limit** → 400 (413 for media size) naming the limit, before
  any GPU work;
* the vector is charged against the **in-flight budgets** of the stages it will occupy (encoder patches, prefill
  tokens, decode KV blocks) → 429 with Retry-After when one is full; :meth:`Admission.release` gives it back when the
  request leaves, whatever the reason.

Per-request limits are validated to fit inside the budgets, so an admissible request is never refused forever.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.errors import InvalidRequestError, MediaTooLarge, Overloaded
from common.protocol.handoff import ProcessedMedia, TokenizedPrompt


@dataclass(frozen=True)
class ResourceVector:
    media_items: int
    media_bytes: int
    pixels: int
    frames: int
    patches: int
    visual_tokens: int
    text_tokens: int
    max_output_tokens: int
    kv_blocks: int

    @property
    def prompt_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens

    @classmethod
    def of(
        cls,
        prompt: TokenizedPrompt,
        media: Sequence[ProcessedMedia],
        max_output_tokens: int,
        block_size: int,
        media_bytes: int = 0,
    ) -> ResourceVector:
        visual = sum(s.prompt_token_length for s in prompt.spans)
        total = len(prompt.token_ids)
        return cls(
            media_items=len(media),
            media_bytes=media_bytes,
            pixels=sum(m.source_size[0] * m.source_size[1] for m in media),
            frames=sum(m.grid_thw[0] if m.modality == "video" else 1 for m in media),
            patches=sum(m.grid_thw[0] * m.grid_thw[1] * m.grid_thw[2] for m in media),
            visual_tokens=visual,
            text_tokens=total - visual,
            max_output_tokens=max_output_tokens,
            kv_blocks=-(-(total + max_output_tokens) // block_size),
        )


class AdmissionConfig(BaseModel):
    """Per-request limits and in-flight budgets (the ``admission:`` config section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_pixels: int = Field(default=100_000_000, ge=1)
    """Source pixels of all media of one request."""
    max_request_patches: int = Field(default=65_536, ge=1)
    """Vision patches of one request (what the encoder pays for)."""
    max_request_visual_tokens: int = Field(default=16_384, ge=1)
    """Placeholder tokens all media of one request expand to."""
    max_request_prompt_tokens: int = Field(default=32_768, ge=1)
    """Text + visual tokens of one prompt."""
    max_request_output_tokens: int = Field(default=4096, ge=1)
    """Largest ``max_tokens`` accepted."""
    encoder_patch_budget: int = Field(default=262_144, ge=1)
    """Patches admitted and not yet encoded, across requests."""
    prefill_token_budget: int = Field(default=131_072, ge=1)
    """Prompt tokens admitted and not yet prefilled, across requests."""
    decode_kv_block_budget: int = Field(default=65_536, ge=1)
    """KV blocks that admitted requests may hold at once."""
    retry_after_s: float = Field(default=1.0, gt=0)
    """Retry-After sent with 429."""

    @model_validator(mode="after")
    def _limits_fit_budgets(self) -> AdmissionConfig:
        if self.max_request_patches > self.encoder_patch_budget:
            raise ValueError("max_request_patches must not exceed encoder_patch_budget")
        if self.max_request_prompt_tokens > self.prefill_token_budget:
            raise ValueError("max_request_prompt_tokens must not exceed prefill_token_budget")
        return self


_LIMITS = (
    # (vector field, config limit, error class, what)
    ("pixels", "max_request_pixels", MediaTooLarge, "source pixels"),
    ("patches", "max_request_patches", MediaTooLarge, "vision patches"),
    ("visual_tokens", "max_request_visual_tokens", InvalidRequestError, "visual tokens"),
    ("prompt_tokens", "max_request_prompt_tokens", InvalidRequestError, "prompt tokens"),
    ("max_output_tokens", "max_request_output_tokens", InvalidRequestError, "output tokens (max_tokens)"),
)
_BUDGETS = (("patches", "encoder_patch_budget", "encoder"), ("prompt_tokens", "prefill_token_budget", "prefill"))


class Admission:
    """Thread-safe in-flight accounting; ``admit`` and ``release`` must pair (use try/finally)."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._in_flight = {"patches": 0, "prompt_tokens": 0, "kv_blocks": 0}

    def check_limits(self, rv: ResourceVector) -> None:
        for attr, limit_name, err, what in _LIMITS:
            value, limit = getattr(rv, attr), getattr(self.cfg, limit_name)
            if value > limit:
                raise err(f"request has {value} {what}; the limit is {limit}", code=f"too_many_{attr}")

    def admit(self, rv: ResourceVector) -> None:
        self.check_limits(rv)
        with self._lock:
            for attr, budget_name, stage in (*_BUDGETS, ("kv_blocks", "decode_kv_block_budget", "decode")):
                if self._in_flight[attr] + getattr(rv, attr) > getattr(self.cfg, budget_name):
                    raise Overloaded(
                        f"the {stage} stage is at capacity ({budget_name}); retry later",
                        retry_after_s=self.cfg.retry_after_s,
                    )
            for attr in self._in_flight:
                self._in_flight[attr] += getattr(rv, attr)

    def release(self, rv: ResourceVector) -> None:
        with self._lock:
            for attr in self._in_flight:
                self._in_flight[attr] -= getattr(rv, attr)
                if self._in_flight[attr] < 0:
                    raise RuntimeError(f"admission released more {attr} than it admitted")

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)
