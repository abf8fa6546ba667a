"""What the proxy guard (:mod:`services.platform.proxy_http`) reads from a request's headers, before any body byte:
Serve's own control headers (which a client must not set), the API key, the traffic class, the declared body length
and framing, and whether the client waits for ``100 Continue``. Pure functions of the ASGI scope; the ASGI types the
guard's modules share are named here too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from common.auth import bearer_key
from common.protocol.body import ascii_int

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

SERVE_CONTROL_HEADERS = frozenset(
    {
        b"x-request-timeout-seconds",
        b"x-request-disconnect-disabled",
        b"x-request-id",
        b"serve_multiplexed_model_id",
        b"serve-multiplexed-model-id",
        b"x-session-id",
        b"x_session_id",
    }
)
"""Headers Ray Serve 2.60's proxy acts on (``ray.serve._private.constants``): a client must not set them."""
SERVE_CONTROL_PREFIXES = (b"x-serve-router-",)


def serve_control(name: bytes) -> bool:
    name = name.lower()
    return name in SERVE_CONTROL_HEADERS or name.startswith(SERVE_CONTROL_PREFIXES)


def bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            return bearer_key(value.decode("latin-1"))
    return None


def priority(scope: Scope) -> str:
    """The traffic class the ``X-Prism-Priority`` header names (``interactive`` when none, or not one of ours)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-prism-priority" and value.strip().lower() == b"batch":
            return "batch"
    return "interactive"


def expects_continue(scope: Scope) -> bool:
    """Whether the client waits for ``100 Continue`` before it sends its body (``Expect: 100-continue``)."""
    return any(k.lower() == b"expect" and v.strip().lower() == b"100-continue" for k, v in scope.get("headers", ()))


def content_length(scope: Scope) -> tuple[int | None, bool]:
    """The declared body length — ``None`` when there is none to trust: absent, malformed (the HTTP server's to
    refuse), or beside ``Transfer-Encoding`` (which then frames the body, RFC 9112 §6.3) — and whether the body is
    framed by ``Transfer-Encoding``."""
    declared = None
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"transfer-encoding":
            return None, True
        if name == b"content-length":
            declared = ascii_int(value.decode("latin-1"))
    return declared, False
