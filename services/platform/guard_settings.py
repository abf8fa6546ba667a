"""What the proxy guard enforces (:mod:`services.platform.proxy_guard`), as every proxy of a cluster reads it from its
environment: the body limit and its clocks, the gRPC call cap, and per application its route prefix and keys (as
SHA-256 digests and the key file's path — never a key). Built from a Serve config's applications
(:meth:`GuardSettings.of`), carried as JSON in ``PRISM_PROXY_GUARD``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict

from common.auth import KeyStore, key_digests
from common.config import PrismConfig, ServerConfig

ENV_GUARD = "PRISM_PROXY_GUARD"
ENV_MAX_BODY_BYTES = "PRISM_MAX_BODY_BYTES"


class GuardRoute(BaseModel):
    """One application behind the proxy, as far as the guard needs to know it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    app: str
    """Its Serve application name (gRPC calls name it in their ``application`` metadata)."""
    prefix: str
    """Its HTTP route prefix (a request goes to the application with the longest prefix of its path)."""
    digests: dict[str, str] = {}
    """Its inline API keys as SHA-256 hex digest → tenant."""
    keys_file: str | None = None
    """Its API key file (re-read when it changes, as the ingress does)."""
    reload_s: float = 5.0
    weights: dict[str, float] = {}
    """Tenants' weights where they differ from ``default_weight`` (the front door's shares)."""
    default_weight: float = 1.0

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    @property
    def keyed(self) -> bool:
        return bool(self.digests) or self.keys_file is not None

    def key_store(self) -> KeyStore:
        server = ServerConfig(api_keys_file=self.keys_file, api_keys_reload_s=self.reload_s)
        return KeyStore(server, digests=self.digests)


class GuardSettings(BaseModel):
    """What every proxy of the cluster enforces (:func:`ray_env` puts it in their environment)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int
    max_json_structure: int
    """Structural characters (``{ [ , :``) a body may hold: counted as it streams through, so a width bomb is refused
    after its first megabyte rather than carried whole to the ingress."""
    chunked_bytes_in_flight: int
    body_grace_s: float
    body_min_bytes_per_s: int
    retry_after_s: float
    grpc_max_concurrent_calls: int
    front_places: int = 256
    """In-flight places of this proxy (or ingress replica, behind HAProxy) shared between tenants once all are taken
    (``server.front_places``)."""
    front_max_waiting: int = 128
    routes: list[GuardRoute] = []
    """Applications whose keys the proxy verifies (none: the proxy authenticates nothing itself)."""

    @classmethod
    def of(
        cls, apps: Iterable[tuple[str, str, PrismConfig]], verify_keys: bool = True, per_ingress_replica: bool = False
    ) -> GuardSettings:
        """From a cluster's applications — ``(name, route prefix, config)`` each. The proxies serve all of them, so
        they take the most permissive of their settings. ``verify_keys``: only where ``apps`` is every application
        the proxies will serve (an application they do not know could be mistaken for the longest prefix they do).
        ``per_ingress_replica``: the guard runs in each ingress replica's own server (behind HAProxy:
        :mod:`services.platform.front_door`), so its default front places are what one replica carries, not what
        every replica of the ingress does behind one proxy."""
        apps = list(apps) or [("prism", "/", PrismConfig())]
        servers = [cfg.server for _, _, cfg in apps]
        limit = max(cfg.body_limit for _, _, cfg in apps)
        routes = [_route(name, prefix, cfg) for name, prefix, cfg in apps] if verify_keys else []
        return cls(
            max_body_bytes=limit,
            max_json_structure=max(s.json_structure_limit for s in servers),
            chunked_bytes_in_flight=max(s.proxy_chunked_bytes_in_flight or 4 * limit for s in servers),
            body_grace_s=max(s.body_read_grace_s for s in servers),
            body_min_bytes_per_s=min(s.body_min_bytes_per_s for s in servers),
            retry_after_s=max(s.retry_after_s for s in servers),
            grpc_max_concurrent_calls=max(s.max_concurrent_grpc_calls for s in servers),
            front_places=max(
                cfg.server.front_places
                or cfg.server.max_in_flight_per_ingress
                * (1 if per_ingress_replica else cfg.deployments.ingress.max_replicas)
                for _, _, cfg in apps
            ),
            front_max_waiting=max(s.front_max_waiting for s in servers),
            routes=[r for r in routes if r.keyed],
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GuardSettings:
        raw = environ.get(ENV_GUARD, "").strip()
        if raw:
            return cls.model_validate_json(raw)
        default = cls.of([])
        limit = environ.get(ENV_MAX_BODY_BYTES, "").strip()
        return default.model_copy(update={"max_body_bytes": int(limit)}) if limit else default

    def route(self, path: str) -> GuardRoute | None:
        """The known application an HTTP request for ``path`` goes to (longest route prefix), if any."""
        matches = [r for r in self.routes if _under(path, r.prefix)]
        return max(matches, key=lambda r: len(r.prefix), default=None)

    def app(self, name: str | None) -> GuardRoute | None:
        """The known application a gRPC call names (the only one, when it names none)."""
        if name:
            return next((r for r in self.routes if r.app == name), None)
        return self.routes[0] if len(self.routes) == 1 else None


def _route(name: str, prefix: str, cfg: PrismConfig) -> GuardRoute:
    server, admission = cfg.server, cfg.admission
    default = admission.default_tenant.weight
    return GuardRoute(
        app=name,
        prefix=prefix,
        digests=key_digests(server.api_keys),
        keys_file=server.api_keys_file,
        reload_s=server.api_keys_reload_s,
        weights={t: q.weight for t, q in admission.tenants.items() if q.weight != default},
        default_weight=default,
    )


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/") or not prefix


def serve_apps(serve_config: Mapping) -> list[tuple[str, str, PrismConfig]]:
    """``(name, route prefix, config)`` of every application of a Serve config (its ``applications``)."""
    return [
        (app.get("name", "default"), app.get("route_prefix", "/"), PrismConfig.model_validate(_config_of(app)))
        for app in serve_config.get("applications", [])
    ]


def _config_of(app: Mapping) -> dict:
    return dict((app.get("args") or {}).get("config") or {})
