"""Per-tenant quotas at the ingress: concurrency caps and token buckets on each budget, charged as costs appear.

Each ingress replica holds one :class:`TenantQuotas` and enforces ``share`` of every tenant's quota (``share`` =
1 / the ingress's ``max_replicas``): no shared state and no extra hop per request, at the price of accuracy — with
Serve spreading requests evenly a tenant gets its quota; with fewer ingress replicas running than ``max_replicas``,
or an uneven spread, it gets less. It can get more where a share rounds up: each replica allows at least one request
in flight and a bucket of at least one unit. (A small quota actor shared by all replicas is the exact alternative;
it would cost a round trip per request and a single point of failure.)

Lifecycle of one request's :class:`Ticket`:

``enter(tenant)`` as soon as the headers named the tenant, before any body byte is read → refused at once (429
``tenant_quota_exceeded`` + Retry-After) if the tenant is at its cap of requests in flight or its request /
prompt-token buckets already refuse it; otherwise the request takes its in-flight place **now**, so a tenant's slow
uploads and large bodies count against its cap while they are read and parsed → ``admit(ticket, vector)`` at the
ingress, once its text tokens are known → refused if the tenant is at its cap of requests with media or any of its
buckets is in debt → otherwise the known costs are taken from the buckets at once (one request, the text tokens) →
:meth:`charge` takes the rest when it becomes known (pixels, patches, visual tokens: the media stage's figures, which
reach the ingress with the decode stream's start) — a bucket may go into debt by the costs of the requests admitted
before the first of them was charged (bound them with ``max_media_in_flight``), and the debt then holds the tenant's
next requests back until it refills → :meth:`release` charges the output tokens the request generated (the
``completion_tokens`` bucket: known only at its end, so a tenant of long generations is held back at its next
requests, as a pixel debt does) and gives the concurrency back on every exit path (idempotent), whether or not the
request was admitted.

Only the tenant's own buckets and counts are consulted: one tenant at its quota never refuses another.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import AdmissionConfig, Rate, TenantQuota
from common.errors import TenantQuotaExceeded
from common.protocol.vector import ResourceVector

BUDGETS = ("requests", "prompt_tokens", "pixels", "patches", "completion_tokens")


class _Bucket:
    def __init__(self, rate: Rate, share: float, now: float) -> None:
        self.per_s, self.burst = rate.per_s * share, max(rate.burst * share, 1.0)
        self.level, self.at = self.burst, now

    def refill(self, now: float) -> float:
        self.level = min(self.burst, self.level + (now - self.at) * self.per_s)
        self.at = now
        return self.level

    def wait_s(self, need: float) -> float:
        """Seconds until the level reaches ``need``."""
        return max(0.0, (need - self.level) / self.per_s)


@dataclass
class _Tenant:
    quota: TenantQuota
    buckets: dict[str, _Bucket]
    in_flight: int = 0
    media_in_flight: int = 0


@dataclass
class Ticket:
    tenant: str
    media: bool = False
    """Holds a place among the tenant's requests with media (set by :meth:`TenantQuotas.admit`)."""
    charged: dict[str, float] = field(default_factory=dict)
    admitted: bool = False
    released: bool = False


class TenantQuotas:
    def __init__(
        self,
        cfg: AdmissionConfig,
        share: float = 1.0,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.cfg, self.share, self.retry_after_s, self.clock = cfg, share, retry_after_s, clock
        self._tenants: dict[str, _Tenant] = {}

    def _tenant(self, name: str) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            quota, now = self.cfg.quota(name), self.clock()
            buckets = {b: _Bucket(getattr(quota, b), self.share, now) for b in BUDGETS if getattr(quota, b)}
            state = self._tenants[name] = _Tenant(quota, buckets)
        return state

    def _cap(self, limit: int | None) -> int | None:
        return None if limit is None else max(1, math.floor(limit * self.share))

    def enter(self, tenant: str) -> Ticket:
        """Before the body is read (the tenant is known from the headers): refuse what :meth:`admit` would refuse
        whatever the body holds — the tenant at its cap of requests in flight, its request bucket empty or its
        prompt-token bucket in debt — so a client that ignores Retry-After costs a refusal no body read by the
        ingress, no parse and no tokenisation; otherwise take the request's in-flight place, held until
        :meth:`release`. What it lets through :meth:`admit` still judges in full (media caps and buckets)."""
        state, now = self._tenant(tenant), self.clock()
        self._check_count(tenant, state.in_flight, state.quota.max_in_flight, "requests")
        for name, need in (("requests", 1.0), ("prompt_tokens", 0.0), ("completion_tokens", 0.0)):
            self._check_bucket(tenant, state, name, need, now)
        state.in_flight += 1
        return Ticket(tenant)

    def admit(self, ticket: Ticket, rv: ResourceVector) -> None:
        """Judge the entered request by its vector: its media cap and every bucket it spends from; take the known
        costs (one request, its prompt tokens) and its place among requests with media."""
        if ticket.admitted or ticket.released:
            raise ValueError("a ticket is admitted once, before it is released")
        tenant = ticket.tenant
        state, now = self._tenant(tenant), self.clock()
        media = rv.media_items > 0
        if media:
            self._check_count(tenant, state.media_in_flight, state.quota.max_media_in_flight, "requests with media")
        now_costs = {"requests": 1.0, "prompt_tokens": float(rv.prompt_tokens)}
        for name in state.buckets:
            if name in ("pixels", "patches") and not media:
                continue  # a text request spends none of these: another budget's debt must not hold it back
            self._check_bucket(tenant, state, name, now_costs.get(name, 0.0), now)
        self.charge(ticket, **now_costs)
        ticket.admitted, ticket.media = True, media
        state.media_in_flight += media

    def _check_count(self, tenant: str, count: int, limit: int | None, what: str) -> None:
        cap = self._cap(limit)
        if cap is not None and count >= cap:
            raise TenantQuotaExceeded(
                f"tenant {tenant!r} has {count} {what} in flight; its quota here is {cap}",
                retry_after_s=self.retry_after_s,
            )

    def _check_bucket(self, tenant: str, state: _Tenant, name: str, cost: float, now: float) -> None:
        bucket = state.buckets.get(name)
        if bucket is None:
            return
        bucket.refill(now)
        need = min(cost, bucket.burst) or 1e-9  # in debt (≤ 0) → wait until it is not
        if bucket.level < need:
            wait = bucket.wait_s(need)
            raise TenantQuotaExceeded(
                f"tenant {tenant!r} is over its {name} rate ({bucket.per_s:g}/s here); retry in {wait:.1f}s",
                retry_after_s=min(60.0, max(1.0, math.ceil(wait - 1e-6))),
            )

    def charge(self, ticket: Ticket, **costs: float) -> None:
        """Take costs that became known after admission (may put a bucket into debt)."""
        state, now = self._tenant(ticket.tenant), self.clock()
        for name, amount in costs.items():
            if amount <= 0:
                continue
            ticket.charged[name] = ticket.charged.get(name, 0.0) + amount
            bucket = state.buckets.get(name)
            if bucket is not None:
                bucket.refill(now)
                bucket.level -= amount

    def release(self, ticket: Ticket, completion_tokens: int = 0) -> None:
        """The request ended, having generated ``completion_tokens``: charged, then its places given back (once)."""
        if ticket.released:
            return
        if completion_tokens > 0:
            self.charge(ticket, completion_tokens=float(completion_tokens))
        ticket.released = True
        state = self._tenant(ticket.tenant)
        state.in_flight -= 1
        state.media_in_flight -= ticket.media

    def in_flight(self) -> dict[str, int]:
        return {name: s.in_flight for name, s in self._tenants.items()}
