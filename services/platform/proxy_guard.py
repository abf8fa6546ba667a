"""Request bodies bounded where their bytes first land: ASGI middleware for Ray Serve's HTTP proxy.

Serve's HTTP proxy pulls a request's body off the socket into its own queue and the ingress replica then pulls it
from there (measured: a 300 MB body grew the proxy actor by 325 MB, and the ingress replica died holding it), so a
limit that only the ingress checks acts after the damage. Serve 2.60 calls the function named by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in every proxy actor when it starts and wraps its ASGI app in the
middlewares it returns; :data:`CALLBACK` (``services.platform.proxy_guard:middlewares``) installs :class:`BodyLimit`:

* a ``Content-Length`` over the limit is answered 413 ``request_too_large`` at once, before one body byte is read;
  one within it streams on (the HTTP server frames the body by it, so it cannot run longer), and the ingress can
  refuse the request from its headers — authentication — before reading the body;
* a body without ``Content-Length`` (a chunked upload) is gathered here, counted as it arrives: at the limit the
  client gets the 413 and the replica is never called; within it, the app gets the body as one message.

Either way the connection is closed after the 413 (uvicorn will not read on past an unread body). The limit is
``PRISM_MAX_BODY_BYTES``, which ``make serve``, the Helm chart and the test clusters set in the environment of
``ray start`` from the config (:meth:`common.config.PrismConfig.body_limit`) — read when the proxy calls
:func:`middlewares`, never at import. Refusals are counted in ``prism_requests_total`` with
``deployment="proxy"``. The ingress keeps its own bound as a second line (and for gRPC, whose messages Serve bounds
with ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware import Middleware

from common.protocol.body import ascii_int

ENV_MAX_BODY_BYTES = "PRISM_MAX_BODY_BYTES"
CALLBACK = "services.platform.proxy_guard:middlewares"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


GRPC_ENVELOPE_BYTES = 64 << 10
"""gRPC message bytes allowed beyond the JSON body (API key, deadline, protobuf framing)."""


def ray_env(max_body_bytes: int) -> dict[str, str]:
    """The environment of ``ray start`` (so of every proxy actor) that bounds request bodies at ``max_body_bytes``:
    this middleware for HTTP, Serve's own message cap for gRPC."""
    return {
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK,
        ENV_MAX_BODY_BYTES: str(max_body_bytes),
        "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(max_body_bytes + GRPC_ENVELOPE_BYTES),
    }


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls at start-up (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``); also where the gRPC
    proxy's listening host is set, when ``make serve`` asks for one (:mod:`services.platform.loopback`)."""
    from services.platform.loopback import bind_grpc_proxy

    bind_grpc_proxy()
    raw = os.environ.get(ENV_MAX_BODY_BYTES, "").strip()
    if raw:
        limit = int(raw)
    else:  # no config told us: the limit the default config derives
        from common.config import PrismConfig

        limit = PrismConfig().body_limit
    return [Middleware(BodyLimit, max_bytes=limit, on_refusal=_count_refusal)]


def refusal_body(max_bytes: int) -> bytes:
    error = {
        "message": f"request body is larger than {max_bytes} bytes, the server's limit",
        "type": "invalid_request_error",
        "code": "request_too_large",
        "param": None,
    }
    return json.dumps({"error": error}).encode()


class BodyLimit:
    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int, on_refusal: Callable[[], None]) -> None:
        self.app, self.max_bytes, self.on_refusal = app, max_bytes, on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send)
                return
            # The HTTP server frames the body by Content-Length: it cannot be longer than declared, so it streams on
            # to the ingress, which can refuse it from its headers (authentication) before reading it.
            await self.app(scope, receive, send)
            return
        body = await self._read_counted(receive)
        if body is False:  # the client went away mid-upload: nobody to answer, nothing to run
            return
        if body is None:
            await self._refuse(send)
            from services.platform.memory import release_freed_memory

            release_freed_memory()
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_counted(self, receive: Receive) -> bytearray | bool | None:
        """A body of unknown length (chunked upload), gathered here up to the limit: ``None`` once over it, ``False``
        if the client disconnected first. The ingress never sees a byte of a refused body, and the one buffer (an
        mmap past glibc's threshold) goes back to the system when it is dropped."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > self.max_bytes:
                return None
            body += chunk
            if not message.get("more_body", False):
                return body

    async def _refuse(self, send: Send) -> None:
        self.on_refusal()
        body = refusal_body(self.max_bytes)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytearray, receive: Receive) -> Receive:
    """A ``receive`` that gives the gathered body as one message, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    """The declared body length; ``None`` when there is none to trust — absent, malformed (the HTTP server's to
    refuse), or beside ``Transfer-Encoding`` (which then frames the body, RFC 9112 §6.3)."""
    declared = None
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            declared = ascii_int(value.decode("latin-1"))
    return declared


_counter: Any = None


def _count_refusal() -> None:
    """``prism_requests_total{protocol="http", status="413", code="request_too_large", deployment="proxy"}``, recorded
    in the proxy actor (Ray's metrics agent exports it beside the ingress's series)."""
    global _counter
    try:
        import ray
        from ray.util.metrics import Counter

        from common.obs.catalogue import BY_NAME, SERVE_TAGS

        if _counter is None:
            spec = BY_NAME["prism_requests_total"]
            _counter = Counter(spec.name, description=spec.description, tag_keys=(*SERVE_TAGS, *spec.tags))
        node = ray.get_runtime_context().get_node_id()[:12]  # one proxy per node
        tags = {"application": "", "deployment": "proxy", "replica": node}
        _counter.inc(1.0, tags={**tags, "protocol": "http", "status": "413", "code": "request_too_large"})
    except Exception:  # metrics must never turn a refusal into a failure
        pass
