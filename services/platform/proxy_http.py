"""The HTTP side of the proxy guard (:mod:`services.platform.proxy_guard`): ASGI middleware around Serve's HTTP proxy.

Lifecycle of one HTTP request here, each refusal answered at once with an OpenAI error body and ``Connection:
close`` (and counted in ``prism_requests_total{deployment="proxy"}``):

1. **Headers.** Serve's own control headers sent by the client — the request's timeout, turning off
   cancel-on-disconnect, the request id, multiplexing and session routing — are dropped: only Serve sets them.
2. **Key.** For an application whose keys the guard knows (its route prefix), a request that may carry a body (any
   method but GET, HEAD, OPTIONS) without a valid ``Authorization: Bearer`` key is refused 401 before one body byte
   is read; a GET/HEAD/OPTIONS request that declares a body is refused 400 (nothing Prism serves takes one).
3. **Size.** A declared ``Content-Length`` over the limit: 413, unread.
4. **Place.** A request with a tenant (its key known here) takes a place at the front door
   (:class:`common.admission.front.FrontDoor`) before its body is read, and holds it until its response ends: while
   the proxy holds fewer than ``front_places`` requests, at once; past them, a tenant below its fair share of the
   places (by weight, between the tenants that want them) still at once, and a tenant at its share waits in a queue of
   its own — its body unread — or, with ``front_max_waiting`` of its requests queued already, is refused 429
   ``tenant_share_exceeded`` + Retry-After (counted as the admission stage ``front``). So a flood from one
   key cannot hold every place of the proxy and the ingress behind it, and a tenant alone may use them all.
5. **Width.** The body's structural characters (``{ [ , :``) are counted as it passes: past ``max_json_structure``
   it is a 400 ``json_too_wide`` — a width bomb is counted over its first megabyte, never held whole and never
   reaches the parser (the ingress counts again before it parses).
6. **Arrival.** The body must keep arriving: past ``body_grace_s`` of waiting on the client, it must have come at
   ``body_min_bytes_per_s`` on average for the time spent waiting for it (time the server spent not reading — the
   request queued for an ingress replica — does not count). A body that falls behind is a 408: the client gets the
   answer, and the application sees the client leave (``http.disconnect``), which frees whatever it held.
7. **Body.** A body of up to 1 MiB, or one without a declared length (a chunked upload), is gathered here whole
   before the application is called — a slow client costs the ingress nothing until its body is in — counted as it
   arrives against the limit (413) and against the bytes this proxy gathers at once over every request
   (``chunked_bytes_in_flight``: 503 + Retry-After — for a tenant that holds its weighted share of them already,
   so one key's uploads cannot lock the others out), then handed on as one message. A larger declared body streams on
   to the ingress as it arrives (the HTTP server frames it by its length, so it cannot run longer), in pieces of at
   least 64 KiB; the ingress authenticates again from the headers before reading it.

A refusal decided part-way through a body (steps 5 and 7), and an application's answer that starts before the body is
all in (the ingress refuses a request on its headers: 415, 429), go out once the rest of the body has been read and
dropped (:meth:`ProxyGuard._drain`: up to ``max_body_bytes`` in all, under the arrival rule, nothing kept), and close
the connection. Both halves matter, measured behind HAProxy: an HTTP server that closes a connection with request
bytes unread resets it, and the reset cost the client the answer's body for 3 in 100–120 (85 MB width bombs; 20 MB
bodies answered 415) — servers drain before closing, as nginx's lingering close does; and an answer that leaves the
connection open has the server read the rest of the body at whatever pace the client sends it, with no bound (a
client that sent one byte every 3 s after its 415 held the connection past 45 s). A refusal that closes with bytes
still unread (401 and 413 before any is read, a drain cut short by its bounds) is written corked, head and body in one
segment (:mod:`services.platform.whole_answer`): split in two, the reset could land between them behind HAProxy
(measured: the body of a 401 to a 150 MB upload lost 11 times in 150; corked, 0 in 150).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from common.admission.front import FrontDoor
from common.admission.record import AdmissionRecorder, MetricSink
from common.auth import KeyStore
from common.errors import InvalidRequestError, PrismError, ProxyBusy, RequestTooLarge
from services.platform.body_arrival import Arrival, Structure, TooSlow, too_slow
from services.platform.guard_settings import GuardSettings
from services.platform.proxy_metrics import ProxySink, count_refusal
from services.platform.request_headers import (
    App,
    Message,
    Receive,
    Scope,
    Send,
    bearer,
    content_length,
    expects_continue,
    priority,
    serve_control,
)
from services.platform.whole_answer import whole_answer

Tenant = tuple[str, str] | None
"""A request's tenant as the guard knows it: ``(application, tenant name)``, ``None`` where it knows no keys."""
BODYLESS = frozenset({"GET", "HEAD", "OPTIONS"})
BUFFER_BYTES = 1 << 20
"""A body up to this size (declared, or chunked of any size) is gathered here whole before the application is called:
a slow client costs the ingress nothing until its body is in (as nginx buffers request bodies); a larger declared
body streams on as it arrives."""
COALESCE_BYTES = 64 << 10
"""Body bytes handed to the application at once, at least (unless the body ends first)."""


class ProxyGuard:
    def __init__(
        self,
        app: App,
        settings: GuardSettings,
        on_refusal: Callable[[int, str], None] | None = None,
        sink: MetricSink | None = None,
    ) -> None:
        self.app, self.settings = app, settings
        self.on_refusal = on_refusal or count_refusal
        self.stores: dict[str, KeyStore] = {r.app: r.key_store() for r in settings.routes}
        self.gathering = 0
        """Bytes of bodies this proxy gathers right now (step 7)."""
        self.gathering_by: dict[Tenant, int] = {}
        """The same, by tenant (``None``: requests the guard names no tenant for)."""
        routes = {r.app: r for r in settings.routes}
        self.weight: Callable[[Tenant], float] = lambda who: 1.0 if who is None else routes[who[0]].weight(who[1])
        self.door = FrontDoor(
            settings.front_places,
            settings.front_max_waiting,
            settings.retry_after_s,
            weight=self.weight,
        )
        """The in-flight places shared between tenants (step 4); a tenant is ``(application, tenant name)``."""
        in_proxy = sink is None and on_refusal is None  # (in a proxy actor; a test passes its own or records nothing)
        self.recorders = {
            r.app: AdmissionRecorder(ProxySink(r.app) if in_proxy else sink, "front") for r in settings.routes
        }
        """The front door's decisions, counted as each application's stage ``front``."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["headers"] = [(k, v) for k, v in scope.get("headers", ()) if not serve_control(k)]
        try:
            declared, tenant = self._admit(scope)
        except PrismError as exc:
            await self._refuse(send, exc)
            return
        if tenant is not None and not await self._enter(tenant, priority(scope), send):
            return
        arrival = Arrival(self.settings.body_grace_s, self.settings.body_min_bytes_per_s)
        try:
            if declared is not None and declared > BUFFER_BYTES:
                await self._stream(scope, receive, send, arrival)
            else:
                await self._gathered(scope, receive, send, arrival, tenant)
        finally:
            arrival.close()
            if tenant is not None:
                self.door.leave(tenant)

    async def _enter(self, tenant: tuple[str, str], cls: str, send: Send) -> bool:
        """Take the request's place at the front door (step 4), or answer its refusal; False if refused (counted
        under the header's traffic class ``cls``: the body's is not known yet)."""
        start = time.monotonic()
        try:
            await self.door.enter(tenant)
        except PrismError as exc:
            self.recorders[tenant[0]].refused(tenant[1], cls, "tenant_share")
            await self._refuse(send, exc)
            return False
        waited = time.monotonic() - start
        self.recorders[tenant[0]].admitted(tenant[1], cls, waited if waited > 1e-3 else 0.0)
        return True

    def _admit(self, scope: Scope) -> tuple[int | None, Tenant]:
        """The checks on the headers (steps 2–3); the declared body length (``None`` when there is none to trust)
        and the request's tenant as ``(application, name)`` (``None``: a request without a body, or for an
        application whose keys the guard does not know)."""
        declared, chunked = content_length(scope)
        method = scope.get("method", "GET").upper()
        if method in BODYLESS:
            if chunked or declared:
                raise InvalidRequestError(f"a {method} request carries no body here")
            return 0, None
        route = self.settings.route(scope.get("path", "/"))
        tenant = None
        if route is not None:
            tenant = (route.app, self.stores[route.app].tenant(bearer(scope)))  # 401 before a body byte is read
        if declared is not None and declared > self.settings.max_body_bytes:
            raise RequestTooLarge(
                f"request body is larger than {self.settings.max_body_bytes} bytes, the server's limit"
            )
        return declared, tenant

    async def _stream(self, scope: Scope, receive: Receive, send: Send, arrival: Arrival) -> None:
        """A body of declared length, streamed on as the application pulls it, under the arrival rule. A body that
        falls behind is answered 408 from within ``receive``. A refused one (its width), and an application's answer
        that starts before the body is all in, go out once the application has returned and the rest of the body is
        drained, closing the connection — here, not in ``receive`` or ``send``, which Serve's direct ingress calls
        from tasks of its own."""
        state: dict[str, Any] = {"responded": False, "started": False, "refusal": None}
        structure = Structure(self.settings.max_json_structure)
        early: list[Message] = []  # the application's answer, held: it started before the body was all in

        async def guarded_receive() -> Message:
            if state["responded"]:
                return {"type": "http.disconnect"}
            if arrival.ended:  # the whole body is in: the application listens for a disconnect, unguarded
                return await receive()
            try:
                message = await self._coalesced(receive, arrival, structure)
            except (TooSlow, PrismError) as exc:
                if (not state["started"] or early) and not state["responded"]:  # (a held answer never went out)
                    state["responded"] = True
                    if isinstance(exc, TooSlow):
                        await self._refuse(send, too_slow(self.settings))
                    else:
                        state["refusal"] = exc
                return {"type": "http.disconnect"}  # the application sees the client leave: it frees what it held
            return message

        async def guarded_send(message: Message) -> None:
            if state["responded"]:
                return  # the guard answers (or answered) instead
            if message["type"] == "http.response.start":
                state["started"] = True
                if not arrival.ended:
                    early.append(_closing(message))
                    return
            if early:
                early.append(message)
                return
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if state["refusal"] is None and not _complete(early):
                raise  # (the application's own failure; with an answer to give, it failed on the client leaving)
        if state["refusal"] is not None or _complete(early):
            state["responded"] = True  # (a read of Serve's still under way ends with its piece)
            await self._answer_drained(receive, send, arrival, state["refusal"], early, expects_continue(scope))

    async def _answer_drained(
        self,
        receive: Receive,
        send: Send,
        arrival: Arrival,
        refusal: PrismError | None,
        held: list[Message],
        waits_for_continue: bool,
    ) -> None:
        """The guard's refusal, or else the application's held answer, once the rest of the body is drained — but a
        client that waits for ``100 Continue`` before it sends its body and has sent none is answered at once: reading
        would ask it for the body (the server sends the 100 when it is first asked for a piece)."""
        if not (waits_for_continue and arrival.received == 0):
            await self._drain(receive, arrival)
        if refusal is not None:
            await self._refuse(send, refusal)
            return
        with whole_answer(send):  # (the drain may have stopped short: the close may reset the connection; no await
            # after the last send in here — whole_answer's docstring)
            for message in held:
                await send(message)

    async def _coalesced(self, receive: Receive, arrival: Arrival, structure: Structure) -> Message:
        """The next body message for the application: the client's pieces joined until ``COALESCE_BYTES`` or the end
        of the body — a client that trickles its body costs the application one message per 64 KiB, not one per
        packet (each is a call from the ingress replica to this proxy)."""
        message = await arrival.receive(receive)
        if message["type"] != "http.request":
            return message
        parts = [message.get("body", b"")]
        size, more = len(parts[0]), message.get("more_body", False)
        structure.add(parts[0])
        while more and size < COALESCE_BYTES:
            nxt = await arrival.receive(receive)
            if nxt["type"] != "http.request":
                return nxt  # the client left mid-body: that is what the application must see
            parts.append(nxt.get("body", b""))
            structure.add(parts[-1])
            size, more = size + len(parts[-1]), nxt.get("more_body", False)
        return {"type": "http.request", "body": b"".join(parts), "more_body": more}

    async def _gathered(self, scope: Scope, receive: Receive, send: Send, arrival: Arrival, tenant: Tenant) -> None:
        """A body of unknown length, gathered here (step 7) and handed on as one message; the bytes count against
        the proxy's budget until the application takes them (or returns without)."""
        held = [0]

        def give_back() -> None:
            self.gathering -= held[0]
            left = self.gathering_by.pop(tenant, 0) - held[0]
            if left:
                self.gathering_by[tenant] = left
            held[0] = 0

        try:
            body = await self._gather(receive, arrival, held, tenant)
        except TooSlow:
            give_back()
            await self._refuse(send, too_slow(self.settings))
            return
        except PrismError as exc:
            give_back()
            await self._drain(receive, arrival)
            await self._refuse(send, exc)
            from services.platform.memory import release_freed_memory

            release_freed_memory()
            return
        if body is None:  # the client went away mid-upload: nobody to answer, nothing to run
            give_back()
            return
        try:
            await self.app(scope, _replay(body, receive, give_back), send)
        finally:
            give_back()

    async def _gather(self, receive: Receive, arrival: Arrival, held: list[int], tenant: Tenant) -> bytearray | None:
        # One growing buffer rather than a list of chunks: past glibc's mmap threshold it lives in its own mapping, so
        # a refused body's memory goes back to the system at once instead of staying in the heap.
        body = bytearray()
        structure = Structure(self.settings.max_json_structure)
        while True:
            message = await arrival.receive(receive)
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            structure.add(chunk)
            if len(body) + len(chunk) > self.settings.max_body_bytes:
                raise RequestTooLarge(f"request body is larger than {self.settings.max_body_bytes} bytes, the limit")
            if self.gathering + len(chunk) > self.settings.chunked_bytes_in_flight and self._past_share(
                tenant, len(chunk)
            ):
                raise ProxyBusy("the server is gathering as many uploads as it may hold; retry later",
                                retry_after_s=self.settings.retry_after_s)  # fmt: skip
            self.gathering += len(chunk)
            self.gathering_by[tenant] = self.gathering_by.get(tenant, 0) + len(chunk)
            held[0] += len(chunk)
            body += chunk
            if not message.get("more_body", False):
                return body

    def _past_share(self, tenant: Tenant, nbytes: int) -> bool:
        """Whether ``nbytes`` more would take ``tenant``'s bodies being gathered past its weighted share of the
        gathering budget (between the tenants gathering now, it included): only such a tenant is refused when the
        budget is spent — so one key's uploads cannot lock the others out, the proxy holding up to about twice the
        budget for a while — and a tenant alone is held to the budget."""
        weights = {t: self.weight(t) for t in self.gathering_by} | {tenant: self.weight(tenant)}
        share = self.settings.chunked_bytes_in_flight * weights[tenant] / sum(weights.values())
        return self.gathering_by.get(tenant, 0) + nbytes > share

    async def _drain(self, receive: Receive, arrival: Arrival) -> None:
        """Read and drop the rest of a refused body — while it keeps to the arrival rule and the body read in all stays
        within ``max_body_bytes`` — so that the refusal's connection closes with nothing unread (see the module's
        docstring); past either bound the answer goes out at once."""
        try:
            while not arrival.ended and arrival.received <= self.settings.max_body_bytes:
                await arrival.receive(receive)
        except TooSlow:
            pass

    async def _refuse(self, send: Send, exc: PrismError) -> None:
        self.on_refusal(exc.http_status, exc.code)
        body = _json(exc.to_body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if exc.retry_after_s is not None:
            headers.append((b"retry-after", str(max(1, round(exc.retry_after_s))).encode()))
        with whole_answer(send):  # head and body in one segment: the close may reset the connection (body unread); no
            # await after the last send in here (whole_answer's docstring)
            await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})


def _complete(messages: list[Message]) -> bool:
    """Whether ``messages`` hold a whole answer (its start, and a last body message)."""
    return bool(messages) and messages[-1]["type"] == "http.response.body" and not messages[-1].get("more_body")


def _closing(start: Message) -> Message:
    """A response start that closes the connection after its response (``Connection: close``)."""
    headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"connection"]
    return {**start, "headers": [*headers, (b"connection", b"close")]}


def _json(obj: dict) -> bytes:
    import json

    return json.dumps(obj).encode()


def _replay(body: bytearray, receive: Receive, taken: Callable[[], None]) -> Receive:
    """A ``receive`` that gives the gathered body as one message (calling ``taken``), then defers to the real one
    (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            message = {"type": "http.request", "body": bytes(body), "more_body": False}
            taken()
            return message
        return await receive()

    return replay
