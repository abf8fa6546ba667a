"""Cache scopes: every cache key (processor, encoder, prefix) starts with one, so a hit never crosses tenants.

A tenant's scope is its name. An operator who runs a single-tenant deployment may mark the caches shared; then every
tenant gets the one scope below, which no tenant can collide with (``ServerConfig`` only accepts tenant names of
letters, digits, ``_``, ``.`` and ``-``).
"""

from __future__ import annotations

SHARED_SCOPE = "*shared*"


def cache_scope(tenant: str, shared: bool) -> str:
    return SHARED_SCOPE if shared else tenant
