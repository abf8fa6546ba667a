"""Ingress deployment: the OpenAI-compatible HTTP API and the gRPC API, over one :class:`PipelineClient` per served
model — a request goes to the model its ``model`` field names (404 ``model_not_found`` listing the served ones).

HTTP: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``. gRPC: ``prism.v1.Prism``
(``Generate`` unary, ``GenerateStream`` server-streaming; ``services/proto/prism.proto``). Each replica admits at most
``server.max_in_flight_per_ingress`` requests and answers the rest with 429 + Retry-After (gRPC
``RESOURCE_EXHAUSTED``) and an OpenAI error body. A client that disconnects cancels the decode stream, which frees
the sequence's KV, and Serve propagates the cancellation to the stages still working for it.

Every entry point runs its request inside one :class:`RequestLifecycle` (:mod:`services.ingress.lifecycle`): it takes an
in-flight place and closes exactly once — metrics + one JSON log line through the :class:`RequestObserver`, the
decode stream cancelled, the place given back. With ``X-Prism-Trace: 1`` the trace summary is returned as
``prism_trace`` in the JSON body, in the last SSE chunk (the usage chunk when the client asked for one), or in an
error body; over gRPC (metadata ``x-prism-trace: 1``) as the ``prism-trace`` trailing metadata.
"""

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.admission.quota import TenantQuotas, Ticket
from common.admission.record import AdmissionRecorder
from common.auth import KeyStore, bearer_key
from common.config import PrismConfig
from common.errors import (
    InvalidRequestError,
    ModelNotFound,
    Overloaded,
    PrismError,
    RequestTooLarge,
    TenantQuotaExceeded,
)
from common.model.loader import load_frontend
from common.protocol.body import decode_json
from services.ingress.answer import calls_json
from services.ingress.body import BodyBytes, off_loop, read_json
from services.ingress.call_stream import Call
from services.ingress.chain import Chain
from services.ingress.choices import ChoiceStream, WholeChoice, as_json, logprob_entries, whole_choice
from services.ingress.grpc_errors import grpc_abort
from services.ingress.lifecycle import InFlight, RequestLifecycle
from services.ingress.local_handles import local_pipeline
from services.ingress.observer import RequestObserver
from services.ingress.openai_format import (
    choice_body,
    chunk,
    completion_body,
    error_body,
    error_response,
    sse,
    usage,
)
from services.ingress.pipeline import PipelineClient
from services.ingress.plan import RequestHeaders
from services.platform.loopback import bind_replica
from services.proto import prism_pb2

api = FastAPI(title="Prism", docs_url=None, redoc_url=None)


class IngressDeployment:
    def __init__(self, config: dict[str, Any], pipelines: list[list[DeploymentHandle | None]]) -> None:
        """``pipelines``: per served model, in the config's order, its media handle (``None`` where its topology groups
        media with encode) and one handle per group of its topology (``E/P/D``: encode, prefill, decode); empty for a
        model served in this replica (``deployments.in_ingress``), whose group is built here."""
        bind_replica()  # make serve: the replica's own gRPC server on loopback too (services.platform.loopback)
        self.cfg = PrismConfig.model_validate(config)
        self.keys = KeyStore(self.cfg.server)
        server = self.cfg.server
        # Each ingress replica enforces its share of every tenant quota (see common.admission.quota on the accuracy).
        share = 1.0 / self.cfg.deployments.ingress.max_replicas
        self.quotas = TenantQuotas(self.cfg.admission, share, server.retry_after_s)
        self.observer = RequestObserver(self.cfg.observability)
        metrics = self.observer.metrics
        self.recorder = AdmissionRecorder(metrics, "ingress")  # every admission decision of this replica
        self.clients: dict[str, PipelineClient] = {}
        for sub, handles in zip(self.cfg.served(), pipelines, strict=True):
            frontend = load_frontend(sub.model)  # served under the name the frontend reports
            if sub.deployments.in_ingress:  # (its stages in this replica: no Serve hop after the proxy)
                handles = local_pipeline(sub)
            chain = Chain(sub, *handles)
            self.clients[frontend.served_name] = PipelineClient(
                sub, frontend, chain, self.quotas, self.recorder, metrics
            )
        self.places = InFlight(server.max_in_flight_per_ingress, server.retry_after_s, self._load)
        self.bodies = BodyBytes(self.cfg.body_bytes_in_flight, server.retry_after_s)
        self.observer.metrics.keep_fresh(lambda: self._load(self.places.count))

    def _load(self, in_flight: int) -> None:
        metrics = self.observer.metrics
        metrics.load(in_flight, in_flight)
        metrics.grammar()
        for tenant, count in self.quotas.in_flight().items():
            metrics.set("prism_tenant_in_flight", count, tenant=tenant)

    def _authorize(self, life: RequestLifecycle, headers: RequestHeaders) -> Ticket:
        """The tenant of the request's key (401 otherwise), entered into its quota before any body byte is read
        (:meth:`TenantQuotas.enter`): refused at once (429 ``tenant_quota_exceeded``) when its quota refuses it
        whatever the body holds — a client hammering past its Retry-After then costs no body read here, no parse, no
        tokenisation — otherwise holding its in-flight place while its body is read, given back when the request
        closes. A refusal is counted like the ingress's other admission decisions (under the header's class: the
        body's ``priority`` is not read yet; an invalid header counts as interactive — a label is never a value the
        client made up — and the 429 stands)."""
        tenant = self.keys.tenant(headers.api_key)
        life.trace.tenant = tenant
        try:
            ticket = self.quotas.enter(tenant)
        except TenantQuotaExceeded:
            self.recorder.refused(tenant, headers.header_class, "quota")
            raise
        life.hold(lambda: self.quotas.release(ticket, completion_tokens=len(life.trace.token_times)))
        return ticket

    async def _read_body(self, request: Request, headers: RequestHeaders, tenant: str) -> tuple[Any, int]:
        """The HTTP body and its size, within the replica's body bytes in flight (a refusal counted as the
        ingress's)."""
        try:
            return await read_json(request, self.cfg.server, self.cfg.body_limit, self.bodies)
        except Overloaded:
            self.recorder.refused(tenant, headers.header_class, "budget_full")
            raise

    def _client(self, body: Any) -> PipelineClient:
        """The served model the request names (404 ``model_not_found`` listing the served ones otherwise)."""
        name = body.get("model") if isinstance(body, dict) else None
        client = self.clients.get(name) if isinstance(name, str) else None
        if client is not None:
            return client
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
        if not isinstance(name, str):
            raise InvalidRequestError("`model` (a string) is required", param="model")
        served = ", ".join(repr(n) for n in self.clients)
        raise ModelNotFound(f"model {name[:64]!r} is not served here; served: {served}", param="model")

    def _lifecycle(self, protocol: str, headers: RequestHeaders) -> RequestLifecycle:
        traced = self.observer.wants_trace(headers.trace)
        return RequestLifecycle(self.observer, self.places, protocol, traced, headers.traceparent)

    # ---- HTTP ---------------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.keys.tenant(bearer_key(request.headers.get("authorization")))
        except PrismError as exc:
            return error_response(exc)
        cards = [
            {
                "id": client.frontend.served_name,
                "object": "model",
                "created": 0,
                "owned_by": "prism",
                "root": str(client.frontend.model_dir),
                "modalities": ["text", *client.frontend.adapter.modalities],
                "prism_contract": client.frontend.contract.model_dump(),
            }
            for client in self.clients.values()
        ]
        return JSONResponse({"object": "list", "data": cards})

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        get = request.headers.get
        headers = RequestHeaders.read(get, bearer_key(get("authorization")), get("x-prism-deadline-ms"))
        life = self._lifecycle("http", headers)
        try:
            async with life:
                client, call = await self._http_begin(life, request, headers)
                if call.req.stream:
                    # The body outlives this handler: the response closes the lifecycle (also if its body never ran).
                    return _LifecycleStream(self._sse(life.detach(), client, call), life)
                return JSONResponse(await self._completion(life, client, call), headers=life.response_headers())
        except Exception:  # closed by the lifecycle under its typed error
            if life.error is None:  # a cancellation Serve raised as an exception: the client is gone
                raise
            return error_response(life.error, life.summary(), life.response_headers())

    async def _http_begin(
        self, life: RequestLifecycle, request: Request, headers: RequestHeaders
    ) -> tuple[PipelineClient, Call]:
        """From the headers, before any body byte is read: the key, and the tenant's quota as far as it can judge;
        then the body (bounded, parsed off the loop), the model it names, and the chain issued."""
        ticket = self._authorize(life, headers)
        body, size = await self._read_body(request, headers, ticket.tenant)
        client = self._client(body)
        life.call = await client.begin(ticket, body, headers, life.trace, size)
        return client, life.call

    async def _completion(self, life: RequestLifecycle, client: PipelineClient, call: Call) -> dict[str, Any]:
        """The non-streaming answer's body (the lifecycle closed as OK once every token is in)."""
        collected = await client.collect(call)
        life.close()
        with_ids = call.req.return_token_ids
        choices = [whole_choice(call, i, out_ids, finish) for i, (out_ids, finish) in enumerate(collected)]
        bodies = [choice_body(c.index, c.message, c.finish, c.out_ids, with_ids, c.logprobs) for c in choices]
        spent = sum(len(c.out_ids) for c in choices)
        body = completion_body(call.rid, call.frontend.served_name, bodies, call.prompt_ids, spent, with_ids)
        if life.traced:
            body["prism_trace"] = life.summary()
        return body

    async def _sse(self, life: RequestLifecycle, client: PipelineClient, call: Call) -> AsyncIterator[str]:
        """OpenAI's stream: a role chunk per choice, content chunks (each with its choice's ``index``; ``n`` > 1
        interleaves them), each choice's chunk with its finish reason, and — only when the client set
        ``stream_options.include_usage`` — a usage chunk with no choices (every other chunk then carries ``usage:
        null``). ``prism_trace`` and ``prompt_token_ids`` ride on the last chunk, whichever it is."""
        rid, model, created = call.rid, call.frontend.served_name, int(time.time())
        options = call.req.stream_options
        with_usage = options is not None and options.include_usage
        nulls = {"usage": None} if with_usage else {}
        choices = [ChoiceStream(call, i) for i in range(call.sampling.n)]
        running = len(choices)
        try:
            for i in range(len(choices)):
                yield chunk(rid, model, created, {"role": "assistant", "content": ""}, top=nulls, index=i)
            async for index, token, finish in client.tokens(call):
                if finish is None:
                    for delta, fields in choices[index].push(token):
                        yield chunk(rid, model, created, delta, top=nulls, **fields)
                    continue
                pieces, reason = choices[index].end(token, finish)
                for delta, fields in pieces[:-1]:
                    yield chunk(rid, model, created, delta, top=nulls, **fields)
                (delta, fields), running = pieces[-1], running - 1
                if running:
                    yield chunk(rid, model, created, delta, reason, top=nulls, **fields)
                    continue
                life.close()
                last = _last_fields(life, call)
                yield chunk(rid, model, created, delta, reason, top=nulls if with_usage else last, **fields)
                if with_usage:
                    spent = usage(call.prompt_ids, sum(len(c.out_ids) for c in choices))
                    final: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created}
                    yield sse({**final, "model": model, "choices": [], "usage": spent, **last})
        except Exception as exc:  # mid-stream failure: an error event, then the stream ends cleanly
            typed = life.close(exc)
            if typed is None:  # cancelled: nobody to tell
                raise
            yield sse(error_body(typed, life.summary()))
        finally:
            life.abandon()  # no-op once closed; otherwise the client went away (cancels the stream, frees its KV)
        yield "data: [DONE]\n\n"

    # ---- gRPC (method names are the service's RPCs) -------------------------------------------------------
    async def Generate(self, request: prism_pb2.GenerateRequest, grpc_context) -> prism_pb2.GenerateResponse:
        headers = _grpc_headers(request, grpc_context)
        life = self._lifecycle("grpc", headers)
        try:
            async with life:
                client, call = await self._grpc_begin(life, request, headers)
                collected = await client.collect(call)
                choices = [_grpc_choice(whole_choice(call, i, *got)) for i, got in enumerate(collected)]
                first = choices[0]
                response = prism_pb2.GenerateResponse(
                    id=call.rid,
                    text=first.text,
                    token_ids=first.token_ids,
                    prompt_token_ids=call.prompt_ids,
                    finish_reason=first.finish_reason,
                    usage=_grpc_usage(call, sum(len(c.token_ids) for c in choices)),
                    tool_calls_json=first.tool_calls_json,
                    logprobs_json=first.logprobs_json,
                    choices=choices,
                )
                life.close()
                return response
        except Exception:
            if life.error is None:  # cancelled
                raise
            raise grpc_abort(grpc_context, life.error) from None
        finally:
            _grpc_trace(grpc_context, life)

    async def _grpc_begin(
        self, life: RequestLifecycle, request: prism_pb2.GenerateRequest, headers: RequestHeaders
    ) -> tuple[PipelineClient, Call]:
        """Authenticate (before the JSON is parsed), bound and parse the message, route it, and issue the chain."""
        ticket = self._authorize(life, headers)
        raw = request.chat_completion_json.encode()
        if len(raw) > self.cfg.body_limit:  # Serve bounds the whole message too: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
            raise RequestTooLarge(f"chat_completion_json is {len(raw)} bytes; the limit is {self.cfg.body_limit}")
        server = self.cfg.server
        body = await off_loop(len(raw), decode_json, raw, server.max_json_depth, server.json_structure_limit)
        client = self._client(body)
        life.call = await client.begin(ticket, body, headers, life.trace, len(raw))
        return client, life.call

    async def GenerateStream(self, request: prism_pb2.GenerateRequest, grpc_context):
        headers = _grpc_headers(request, grpc_context)
        life = self._lifecycle("grpc", headers)
        try:
            async with life:
                client, call = await self._grpc_begin(life, request, headers)
                choices = [ChoiceStream(call, i) for i in range(call.sampling.n)]
                running = len(choices)
                async for index, token, finish in client.tokens(call):
                    choice, usage_msg, calls = choices[index], None, ""
                    if finish:
                        pieces, finish = choice.end(token, finish)
                        calls, running = calls_json(choice.answer.message()), running - 1
                        if not running:
                            usage_msg = _grpc_usage(call, sum(len(c.out_ids) for c in choices))
                            life.close()
                            _grpc_trace(grpc_context, life)
                    else:
                        pieces = choice.push(token)
                    delta = "".join(d.get("content") or "" for d, _ in pieces)  # (the calls come whole, last)
                    logprobs = logprob_entries(call, index, choice.out_ids, len(choice.out_ids) - 1)
                    yield prism_pb2.GenerateChunk(
                        id=call.rid, delta=delta, token_id=token, finish_reason=finish or "", usage=usage_msg,
                        tool_calls_json=calls, logprobs_json=as_json(logprobs), index=index,
                    )  # fmt: skip
        except Exception:
            if life.error is None:  # cancelled
                raise
            _grpc_trace(grpc_context, life)
            raise grpc_abort(grpc_context, life.error) from None


class _LifecycleStream(StreamingResponse):
    """An SSE response that closes its request's lifecycle however it ends — also when it is cancelled before its
    body ever ran (then the body's own ``finally`` never runs, and Starlette skips background tasks)."""

    def __init__(self, body: AsyncIterator[str], life: RequestLifecycle) -> None:
        super().__init__(body, media_type="text/event-stream", headers=life.response_headers())
        self.life = life

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.life.abandon()  # no-op once the body closed it


def _last_fields(life: RequestLifecycle, call: Call) -> dict[str, Any]:
    """What the stream's last chunk carries beside ``choices``: ``prompt_token_ids`` (when asked for) and
    ``prism_trace`` (when traced)."""
    last: dict[str, Any] = {}
    if call.req.return_token_ids:
        last["prompt_token_ids"] = call.prompt_ids
    if life.traced:
        last["prism_trace"] = life.summary()
    return last


def _grpc_choice(choice: WholeChoice) -> prism_pb2.Choice:
    return prism_pb2.Choice(
        index=choice.index,
        text=choice.message["content"] or "",
        token_ids=choice.out_ids,
        finish_reason=choice.finish,
        tool_calls_json=calls_json(choice.message),
        logprobs_json=as_json(choice.logprobs),
    )


def _grpc_usage(call: Call, completion_tokens: int) -> prism_pb2.Usage:
    return prism_pb2.Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=completion_tokens)


def _grpc_headers(request: prism_pb2.GenerateRequest, grpc_context) -> RequestHeaders:
    """The call's metadata (``authorization: Bearer <key>`` — what the proxy checks before the message is read —,
    ``x-prism-priority``, ``x-prism-trace``), else the message's ``api_key``; the message's deadline budget."""
    metadata = dict(grpc_context.invocation_metadata() or ())
    key = bearer_key(metadata.get("authorization"))
    return RequestHeaders.read(metadata.get, key or request.api_key or None, request.deadline_ms)


def _grpc_trace(grpc_context, life: RequestLifecycle) -> None:
    """gRPC has no body to extend: the trace travels as the ``prism-trace`` trailing metadata (JSON), the exported
    trace's id as ``traceresponse``."""
    metadata = list(life.response_headers().items())
    if life.traced:
        metadata.append(("prism-trace", json.dumps(life.summary(), separators=(",", ":"))))
    if metadata:
        grpc_context.set_trailing_metadata(metadata)


# FastAPI's class-based view rewrite must happen at import time in every process (replicas re-import this module;
# a rewrite done only in the driver would be lost), so the ASGI wrapper is made here, not in the app builder.
IngressApp = serve.ingress(api)(IngressDeployment)
