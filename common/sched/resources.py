"""A request's resource vector, the per-request limits on it, and the ``admission:`` config section.

Prompt length alone says little about a VLM request's cost: one 4K image is thousands of vision patches and visual
tokens behind a ten-word prompt. Every request is measured as a vector (media items and bytes, pixels, frames,
patches, visual tokens, text tokens, max output tokens, KV blocks), filled in as each part becomes known:

* at the ingress (:meth:`ResourceVector.at_ingress`): text tokens (the prompt rendered with one placeholder per
  media item), media items, data-URL bytes, ``max_tokens``. A text-only request is then complete: its KV blocks are
  exact, and every limit is checked there;
* in the media stage, right after the header check and the processor (:meth:`ResourceVector.with_media`): pixels,
  frames, patches, visual tokens — and so the exact prompt length and KV blocks, checked **before** the encoder
  queue.

:func:`check_limits` refuses a vector over a per-request limit with a 4xx naming it (the prompt limit and the
decode KV lease limit included, so neither is first found out after the encoder or prefill ran). The in-flight
budgets each stage admits work against are :mod:`common.sched.gate`; per-tenant quotas are
:mod:`common.sched.quota`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidRequestError, MediaTooLarge

if TYPE_CHECKING:  # (the hand-off types carry a vector: imported for annotations only)
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
        """The whole vector of a built prompt (what the prefill stage sees)."""
        visual = sum(s.prompt_token_length for s in prompt.spans)
        total = len(prompt.token_ids)
        return cls(
            media_items=len(media),
            media_bytes=media_bytes,
            pixels=0,
            frames=0,
            patches=0,
            visual_tokens=0,
            text_tokens=total - visual,
            max_output_tokens=max_output_tokens,
            kv_blocks=0,
        ).with_media(media, block_size, visual_tokens=visual)

    @classmethod
    def at_ingress(
        cls, rendered_tokens: int, media_items: int, max_output_tokens: int, block_size: int, media_bytes: int = 0
    ) -> ResourceVector:
        """What the ingress knows: the prompt rendered with one placeholder token per media item. Each placeholder
        becomes the item's visual tokens later, so ``text_tokens`` excludes them; ``kv_blocks`` is exact for a
        text-only request and a lower bound otherwise."""
        text = rendered_tokens - media_items
        return cls(
            media_items=media_items,
            media_bytes=media_bytes,
            pixels=0,
            frames=0,
            patches=0,
            visual_tokens=media_items,  # at least one token each: the lower bound until the media stage knows
            text_tokens=text,
            max_output_tokens=max_output_tokens,
            kv_blocks=_blocks(rendered_tokens + max_output_tokens, block_size),
        )

    def with_media(
        self,
        media: Sequence[ProcessedMedia],
        block_size: int,
        visual_tokens: int | None = None,
        media_bytes: int | None = None,
    ) -> ResourceVector:
        """The vector completed by the processed media (the media stage, before the encoder queue). ``media_bytes``:
        what the stage fetched and decoded from (URLs included; the ingress could count only data URLs)."""
        visual = sum(m.num_visual_tokens for m in media) if visual_tokens is None else visual_tokens
        return replace(
            self,
            media_items=len(media),
            media_bytes=self.media_bytes if media_bytes is None else media_bytes,
            pixels=sum(m.source_size[0] * m.source_size[1] * _frames(m) for m in media),
            frames=sum(_frames(m) for m in media),
            patches=sum(m.patches for m in media),
            visual_tokens=visual,
            kv_blocks=_blocks(self.text_tokens + visual + self.max_output_tokens, block_size),
        )


def _frames(m: ProcessedMedia) -> int:
    """1 for an image; a video's temporal grid (Qwen2-VL: one per two sampled frames — the media stage counts every
    sampled frame against ``max_request_pixels`` from the headers, before decoding)."""
    return m.grid_thw[0] if m.modality == "video" else 1


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Rate(BaseModel):
    """A token bucket: ``per_s`` units refill each second, up to ``burst``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_s: float = Field(gt=0)
    """Sustained units per second."""
    burst: float = Field(gt=0)
    """Bucket size: units a tenant may spend at once after being idle."""


class TenantQuota(BaseModel):
    """One tenant's share: concurrency caps and token-bucket rates (``None``: no cap)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_in_flight: int | None = Field(default=None, ge=1)
    """Requests of this tenant in flight at once."""
    max_media_in_flight: int | None = Field(default=None, ge=1)
    """Requests with media in flight at once (the ones that occupy the media and encode stages)."""
    requests: Rate | None = None
    """Requests per second."""
    prompt_tokens: Rate | None = None
    """Prompt tokens (text + visual) per second."""
    pixels: Rate | None = None
    """Source pixels per second (what the media stage decodes)."""
    patches: Rate | None = None
    """Vision patches per second (what the encoder computes)."""


class AdmissionConfig(BaseModel):
    """Per-request limits, per-stage in-flight budgets, scheduling classes and tenant quotas (``admission:``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_pixels: int = Field(default=100_000_000, ge=1)
    """Source pixels of all media of one request (a video: its frame size × every frame sampling will decode);
    checked after the header checks, before anything is decoded."""
    max_request_patches: int = Field(default=65_536, ge=1)
    """Vision patches of one request (what the encoder pays for)."""
    max_request_visual_tokens: int = Field(default=16_384, ge=1)
    """Placeholder tokens all media of one request expand to."""
    max_request_output_tokens: int = Field(default=4096, ge=1)
    """Largest ``max_tokens`` accepted."""
    media_pixel_budget: int = Field(default=12_000_000, ge=1)
    """Source pixels one media replica decodes and processes at once (its header-checked items wait for room)."""
    encode_patch_budget: int = Field(default=32_768, ge=1)
    """Vision patches one encode replica holds queued or encoding."""
    prefill_token_budget: int = Field(default=16_384, ge=1)
    """Prompt tokens one prefill replica's long lane holds queued or computing (its low-latency lane holds up to a
    quarter of this again)."""
    max_waiting: int = Field(default=64, ge=0)
    """Requests that may wait for room in one stage replica's budget; more get 429 ``server_overloaded``. A request
    that would wait past its deadline (judged by the budget's drain rate) is refused at once. A request bigger than a
    whole budget is admitted alone, so nothing admissible waits forever."""
    aging_tokens_per_s: float = Field(default=2048, gt=0)
    """Shortest-first with aging: a request of N prompt tokens (patches in encode) ranks as if it arrived
    ``N / aging_tokens_per_s`` seconds later, so short prompts and cache hits (in the prefill engine: tokens left after
    the prefix hit; in encode: patches the encoder cache lacks) pass large images, which still move once they have
    waited that long."""
    lane_max_prompt_tokens: int = Field(default=512, ge=0)
    """Text-only prompts up to this many tokens are prefilled on the prefill replica's low-latency lane: an engine
    and a worker thread of their own (with ``prefill_token_budget`` / 4 and a prefix cache of its own of
    ``prefix_cache_blocks`` / 4, in addition to the long lane's), so they never wait behind a large image prompt's
    chunks. 0: one engine for everything."""
    reserve_kv: bool = True
    """Lease each request's KV blocks on a decode replica before prefill computes (the ingress asks decode first; a
    full pool holds the request back, or refuses it with 429, before any prefill work). Off: decode leases when the
    prefilled KV arrives, as a fallback does when the reserving replica is gone."""
    batch_delay_s: float = Field(default=10.0, ge=0)
    """Batch-class requests rank as if they arrived this many seconds later than interactive ones."""
    retry_after_s: float = Field(default=1.0, gt=0)
    """Retry-After on a 429 when the budget has no drain rate yet to compute one from."""
    default_tenant: TenantQuota = TenantQuota()
    """Quota of every tenant not named in ``tenants``."""
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
    """Quota per tenant name (the names ``server.api_keys`` map keys to)."""

    def quota(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default_tenant)


_LIMITS = (
    # (vector field, config limit, error class, what)
    ("pixels", "max_request_pixels", MediaTooLarge, "source pixels"),
    ("patches", "max_request_patches", MediaTooLarge, "vision patches"),
    ("visual_tokens", "max_request_visual_tokens", InvalidRequestError, "visual tokens"),
    ("max_output_tokens", "max_request_output_tokens", InvalidRequestError, "output tokens (max_tokens)"),
)


def check_limits(rv: ResourceVector, cfg: AdmissionConfig, max_prompt_tokens: int, max_lease_blocks: int) -> None:
    """Refuse a vector over any per-request limit: the admission limits, the prompt limit (``prompt_too_long``) and
    the decode stage's per-request KV lease (``kv_lease_exceeded``, what the decode pool would refuse after
    prefill)."""
    for attr, limit_name, err, what in _LIMITS:
        value, limit = getattr(rv, attr), getattr(cfg, limit_name)
        if value > limit:
            raise err(f"request has {value} {what}; the limit is {limit}", code=f"too_many_{attr}")
    if rv.prompt_tokens > max_prompt_tokens:
        expanded = f" ({rv.visual_tokens} of them for {rv.media_items} media items)" if rv.media_items else ""
        raise InvalidRequestError(
            f"prompt is {rv.prompt_tokens} tokens{expanded}; the limit is {max_prompt_tokens}",
            code="prompt_too_long",
            param="messages",
        )
    if rv.kv_blocks > max_lease_blocks:
        raise InvalidRequestError(
            f"request needs {rv.kv_blocks} KV blocks (prompt {rv.prompt_tokens} + max_tokens {rv.max_output_tokens} "
            f"tokens); the per-request limit is {max_lease_blocks} blocks",
            code="kv_lease_exceeded",
            param="max_tokens",
        )
