"""Request bodies bounded where their bytes first land: ASGI middleware for Ray Serve's HTTP proxy.

Serve's HTTP proxy pulls a request's body off the socket into its own queue and the ingress replica then pulls it
from there (measured: a 300 MB body grew the proxy actor by 325 MB, and the ingress replica died holding it), so a
limit that only the ingress checks acts after the damage. Serve 2.60 calls the function named by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in every proxy actor when it starts and wraps its ASGI app in the
middlewares it returns; :data:`CALLBACK` (``services.proxy_guard:middlewares``) installs :class:`BodyLimit`:

* a ``Content-Length`` over the limit is answered 413 ``request_too_large`` at once, before one body byte is read;
* a body without ``Content-Length`` (chunked upload), or longer than it said, is counted as it arrives: at the limit
  the client gets the 413 and the proxy's app sees a disconnect, so Serve cancels the replica call and the proxy
  holds no more than the limit for that request.

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

ENV_MAX_BODY_BYTES = "PRISM_MAX_BODY_BYTES"
CALLBACK = "services.proxy_guard:middlewares"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls at start-up (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
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
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        state = {"seen": 0, "refused": False, "started": False}

        async def counted_receive() -> Message:
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > self.max_bytes:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = True
                        await self._refuse(send)
                    return {"type": "http.disconnect"}  # the proxy cancels the replica call
            return message

        async def guarded_send(message: Message) -> None:
            if state["refused"]:
                return  # our 413 is the response; whatever the app says after the disconnect is dropped
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, counted_receive, guarded_send)

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


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None  # a malformed value is the HTTP server's to refuse
    return None


_counter: Any = None


def _count_refusal() -> None:
    """``prism_requests_total{protocol="http", status="413", code="request_too_large", deployment="proxy"}``, recorded
    in the proxy actor (Ray's metrics agent exports it beside the ingress's series)."""
    global _counter
    try:
        from ray.util.metrics import Counter

        from common.obs.catalogue import BY_NAME, SERVE_TAGS

        if _counter is None:
            spec = BY_NAME["prism_requests_total"]
            _counter = Counter(spec.name, description=spec.description, tag_keys=(*SERVE_TAGS, *spec.tags))
        tags = {"application": "", "deployment": "proxy", "replica": os.environ.get("RAY_NODE_ID", "")[:12]}
        _counter.inc(1.0, tags={**tags, "protocol": "http", "status": "413", "code": "request_too_large"})
    except Exception:  # metrics must never turn a refusal into a failure
        pass
