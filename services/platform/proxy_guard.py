"""The front door where request bytes first land — Serve's HTTP and gRPC proxies, or, behind HAProxy
(:mod:`services.platform.front_door`), each ingress replica's own HTTP and gRPC servers — guarded before the
application reads a byte.

Serve's HTTP proxy pulls a request's body off the socket into its own queue and the ingress replica then pulls it
from there (measured: a 300 MB body grew the proxy actor by 325 MB, and the ingress replica died holding it), so a
check that only the ingress makes acts after the damage. Serve 2.60 calls the function named by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in every proxy actor when it starts — before it starts its HTTP and
gRPC servers — and wraps its ASGI app in the middlewares it returns; with HAProxy in front, every ingress replica
does the same for its own servers, when it starts them. :data:`CALLBACK` (:func:`middlewares`) installs:

* for HTTP, :class:`services.platform.proxy_http.ProxyGuard` — Serve's own control headers dropped from what clients
  send; the API key verified from the headers (where the application's keys are known here) and a request without a
  valid one refused 401 before one body byte is read; a ``Content-Length`` over the limit refused 413 unread; bodies
  held to a minimum arrival rate after a grace (408); chunked uploads gathered within a per-proxy budget (503);
* for gRPC, :mod:`services.platform.proxy_grpc` — the key checked from the call's ``authorization`` metadata before
  the message is read, and the concurrent calls capped.

What the guard knows comes from the environment of ``ray start`` (so of every proxy actor), which ``make serve``, the
Helm chart and the test clusters set from the Serve config: :func:`ray_env` of a :class:`GuardSettings` — the body
limit and its clocks, and per application its route prefix and its keys, as SHA-256 digests and the key file's path
(never a key itself). It is read when the proxy calls :func:`middlewares`, never at import. A proxy started without
it still bounds bodies (the default config's limit) and authenticates nothing itself: the ingress always
authenticates too, from the headers, before it reads a body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.middleware import Middleware

from common.config import PrismConfig
from services.platform import front_door, proxy_grpc
from services.platform.guard_settings import ENV_GUARD, ENV_MAX_BODY_BYTES, GuardSettings, serve_apps
from services.platform.priority import worker_env
from services.platform.proxy_http import ProxyGuard

CALLBACK = "services.platform.proxy_guard:middlewares"
__all__ = [
    "CALLBACK",
    "ENV_GUARD",
    "ENV_MAX_BODY_BYTES",
    "GuardSettings",
    "cluster_env",
    "middlewares",
    "ray_env",
    "serve_apps",
]

GRPC_ENVELOPE_BYTES = 64 << 10
"""gRPC message bytes allowed beyond the JSON body (API key, deadline, protobuf framing)."""


def ray_env(settings: GuardSettings) -> dict[str, str]:
    """The environment of ``ray start`` (so of every proxy actor) that installs the guard with ``settings`` — and
    starts the workers at Prism's niceness (:mod:`services.platform.priority`)."""
    return {
        **worker_env(),
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK,
        ENV_GUARD: json.dumps(settings.model_dump(mode="json"), separators=(",", ":")),
        ENV_MAX_BODY_BYTES: str(settings.max_body_bytes),
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(settings.max_body_bytes + GRPC_ENVELOPE_BYTES),
    }


def cluster_env(apps: Iterable[tuple[str, str, PrismConfig]], verify_keys: bool = True) -> dict[str, str]:
    """:func:`ray_env` for a cluster serving ``apps`` (as :meth:`GuardSettings.of` takes them) behind Prism's front
    door — HAProxy where Serve has it (:mod:`services.platform.front_door`), the guard then sized for the ingress
    replica it runs in — with the front door's own environment."""
    front = front_door.env()
    return {**ray_env(GuardSettings.of(apps, verify_keys, per_ingress_replica=bool(front))), **front}


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls at start-up (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): the gRPC guard installed
    (and the gRPC proxy's listening host set, when ``make serve`` asks for one — :mod:`services.platform.loopback`)
    before the proxy starts its servers, and the HTTP guard returned."""
    from services.platform.loopback import bind_grpc_proxy

    bind_grpc_proxy()
    settings = GuardSettings.from_env()
    proxy_grpc.install(settings)
    return [Middleware(ProxyGuard, settings=settings)]
