"""Serve's own gRPC listeners kept on the host ``make serve`` binds everything else to.

``make serve`` runs a loopback-only Ray head (:func:`services.cli.loopback_env`) with Ray's token authentication off
and the local configs anonymous. Two kinds of Serve listener ignore the node address and bind every interface:

* the gRPC proxy listens on ``[::]:<grpc port>`` (``gRPCOptions`` has no host; the HTTP proxy has
  ``http_options.host``);
* every replica starts an inter-deployment gRPC server on ``[::]:0`` — the methods of our deployments, callable
  by anyone who can reach the port; with token auth Ray attaches its interceptor, without it nothing checks.

``make serve`` puts both on loopback through the environment of ``ray start`` (Ray workers inherit it):

* ``PRISM_REPLICA_GRPC_HOST`` (always ``127.0.0.1`` there: the node's address, which Serve dials) — :func:`bind_replica`
  runs first thing in each deployment's constructor (Serve builds the deployment before it starts the replica's gRPC
  server) and replaces the ``add_port_to_grpc_server`` that ``ray.serve._private.replica`` imported;
* ``PRISM_GRPC_HOST`` (the Serve config's ``http_options.host``: the gRPC proxy listens where the HTTP proxy does) —
  :func:`bind_grpc_proxy` runs in each proxy actor through the proxy start-up hook of
  :mod:`services.platform.proxy_guard` (before the proxy starts its gRPC server) and replaces
  ``ray.serve._private.default_impl.add_grpc_address``, which the proxy looks up at call time.

Both are private Ray names: a Ray without them logs an error and keeps Serve's binding, and the ``make serve`` test
that checks every listening socket is on loopback fails rather than the exposure going unnoticed. The Helm chart sets
neither — its proxies and replicas must be reachable across pods (behind the NetworkPolicy, with Ray's token auth on).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

ENV_GRPC_HOST = "PRISM_GRPC_HOST"
ENV_REPLICA_GRPC_HOST = "PRISM_REPLICA_GRPC_HOST"

log = logging.getLogger("prism.loopback")


def _host(env: str) -> str:
    return os.environ.get(env, "").strip()


def _rebound(original: Callable[[Any, str], Any], host: str) -> Callable[[Any, str], Any]:
    bracketed = f"[{host}]" if ":" in host else host

    def bind(server: Any, address: str) -> Any:
        return original(server, f"{bracketed}:{address.rsplit(':', 1)[-1]}")  # same port, our host

    bind.prism_host = host  # type: ignore[attr-defined]
    return bind


def _patch(env: str, module_name: str, attr: str) -> None:
    host = _host(env)
    if not host:
        return
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    original = getattr(module, attr, None)
    if original is None:
        log.error("%s=%s not applied: this Ray has no %s.%s", env, host, module_name, attr)
        return
    if getattr(original, "prism_host", None) != host:
        setattr(module, attr, _rebound(original, host))


def bind_grpc_proxy() -> None:
    """In a Serve proxy actor, before its gRPC server starts: listen on ``PRISM_GRPC_HOST`` (when set)."""
    _patch(ENV_GRPC_HOST, "ray.serve._private.default_impl", "add_grpc_address")


def bind_replica() -> None:
    """In a Serve replica, while its deployment is constructed: its inter-deployment gRPC server listens on
    ``PRISM_REPLICA_GRPC_HOST`` (when set)."""
    _patch(ENV_REPLICA_GRPC_HOST, "ray.serve._private.replica", "add_port_to_grpc_server")
