"""``routing:`` — cache-affinity routing of the encode and prefill calls."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Strict


class RoutingConfig(Strict):
    """Cache-affinity routing of the encode and prefill calls (:mod:`common.sched.affinity`,
    :mod:`services.routers.affinity`)."""

    affinity: bool = True
    """Send a media item's encode call, and a prompt's prefill call, to the replica whose cache holds them (bounded
    by load); off: Serve's default power-of-two-choices router — for a group that ends with decode, Prism's decode
    router, which picks the same way (two at random, the shorter queue; not first-come-first-served, no locality
    preference) and reports its replica set, so that the ingress sees a replica leave."""
    load_factor: float = Field(default=1.25, ge=1.0, le=10.0)
    """The most a replica may carry, as a multiple of the stage's average (requests in flight, and a new key's
    share of recent requests), before work meant for it goes to another replica."""
    prefix_key_tokens: int = Field(default=32, ge=1)
    """Text tokens of a text-only prompt's start that its prefill routing key covers (a prompt with media is keyed
    through its first media item)."""
