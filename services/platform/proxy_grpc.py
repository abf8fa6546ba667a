"""The gRPC side of the proxy guard (:mod:`services.platform.proxy_guard`): Serve's gRPC server, given an interceptor
and a cap on concurrent calls.

Serve 2.60 builds its gRPC proxy's server as ``ray.serve._private.grpc_util.gRPCGenericServer``, whose constructor
passes ``interceptors=()`` and ``maximum_concurrent_rpcs=None`` to grpc.aio's ``Server`` — no hook of Serve's sets
either. :func:`install` (run in each proxy actor by the proxy start-up callback, before the proxy starts its servers)
wraps that base constructor so that, for Serve's server only, it gets:

* :class:`KeyInterceptor` — for an application whose keys the guard knows (named by the call's ``application``
  metadata, or the only one), a call without a valid ``authorization: Bearer <key>`` metadata entry is answered
  ``UNAUTHENTICATED`` (an OpenAI error body as details) by a handler that never reads the request: the message is
  neither received in full nor deserialised. Serve's own services (health, application list) are left alone;
* ``maximum_concurrent_rpcs`` — calls beyond it are answered ``RESOURCE_EXHAUSTED`` by gRPC itself.

The names are private to Ray: a Ray without them logs an error and serves unguarded (the ingress still authenticates
every call); ``tests/unit/services/platform/test_proxy_grpc.py`` starts Serve's own gRPC server through them and fails
when Ray moves them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from common.auth import KeyStore, bearer_key
from common.errors import PrismError
from services.platform.guard_settings import GuardSettings

log = logging.getLogger("prism.proxy")

UNGUARDED = ("/ray.serve.", "/grpc.")
"""Services of Serve's and gRPC's own (health checks, application list, reflection)."""


class KeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self.stores: dict[str, KeyStore] = {r.app: r.key_store() for r in settings.routes}

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(UNGUARDED):
            metadata = dict(details.invocation_metadata or ())
            route = self.settings.app(metadata.get("application"))
            if route is not None:
                try:
                    self.stores[route.app].tenant(bearer_key(metadata.get("authorization")))
                except PrismError as exc:
                    return _refusal(grpc.StatusCode.UNAUTHENTICATED, exc)
        return await continuation(details)


def _refusal(code: grpc.StatusCode, exc: PrismError) -> grpc.RpcMethodHandler:
    """A handler that answers ``code`` without reading the request: as a client-streaming handler, it is called before
    any message is received, and never asks for one."""
    details = json.dumps(exc.to_body())

    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    return grpc.stream_unary_rpc_method_handler(refuse)


def install(settings: GuardSettings) -> bool:
    """Give Serve's gRPC server (built after this runs) the key interceptor and the concurrency cap; True once
    installed. Idempotent: a second call changes nothing."""
    try:
        from ray.serve._private.grpc_util import gRPCGenericServer
    except ImportError:
        gRPCGenericServer = None
    if gRPCGenericServer is None:
        log.error("this Ray has no ray.serve._private.grpc_util.gRPCGenericServer: its gRPC proxy is not guarded")
        return False
    base = gRPCGenericServer.__mro__[1]
    if getattr(base.__init__, "prism_guard", False):
        return True
    original = base.__init__
    interceptors = (KeyInterceptor(settings),) if settings.routes else ()

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(self, gRPCGenericServer):
            kwargs["interceptors"] = (*(kwargs.get("interceptors") or ()), *interceptors)
            kwargs["maximum_concurrent_rpcs"] = settings.grpc_max_concurrent_calls
        original(self, *args, **kwargs)

    init.prism_guard = True  # type: ignore[attr-defined]
    base.__init__ = init
    return True
