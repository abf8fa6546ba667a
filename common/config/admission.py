"""``admission:`` — per-request limits, per-stage in-flight budgets, scheduling classes and tenant quotas."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
    completion_tokens: Rate | None = None
    """Output tokens per second, charged when a request ends (what it generated): a tenant in debt is held back at
    its next requests until the bucket refills."""
    weight: float = Field(default=1.0, ge=0.01, le=100)
    """Its share where tenants wait for the same capacity (a Serve proxy's places, media pixels, encode patches,
    prefill tokens, decode KV blocks): under contention each tenant gets them in proportion to its weight; alone,
    all of them."""


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
    """Requests that may wait for room in one stage replica's budget; more get 429 ``server_overloaded`` — except a
    tenant that holds less than its weighted share of the places, which still waits (so up to about twice this
    wait: a flooder that filled the queue does not lock the other tenants out). A request
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
    reservation_hold_s: float = Field(default=60.0, gt=0)
    """How long a granted KV reservation waits for its sequence to claim it (the request's encode and prefill run
    meanwhile) before the decode replica gives its blocks back, whatever the request's deadline — a reservation never
    outlives its request's media by more than this. A sequence that arrives later leases its blocks on arrival."""
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
