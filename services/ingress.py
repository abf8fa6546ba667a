"""Ingress deployment: the OpenAI-compatible HTTP API and the gRPC API, over one :class:`PipelineClient`.

HTTP: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``, ``GET /health``. gRPC: ``prism.v1.Prism``
(``Generate`` unary, ``GenerateStream`` server-streaming; ``services/proto/prism.proto``). Each replica admits at most
``server.max_in_flight_per_ingress`` requests and answers the rest with 429 + Retry-After (gRPC
``RESOURCE_EXHAUSTED``) and an OpenAI error body. A client that disconnects cancels the decode stream, which frees
the sequence's KV, and Serve propagates the cancellation to the stages still working for it.

Every request, whatever its end, is finished exactly once through the :class:`RequestObserver` (metrics + one
JSON log line); with ``X-Prism-Trace: 1`` the trace summary is returned as ``prism_trace`` in the JSON body, in the
final SSE chunk (the one with ``usage``), or in an error body; over gRPC (metadata ``x-prism-trace: 1``) as the
``prism-trace`` trailing metadata.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.config import PrismConfig
from common.errors import InvalidRequestError, Overloaded, PrismError
from common.model.loader import load_frontend
from common.obs.request_trace import RequestTrace
from common.stages.stops import visible_text
from services.observer import CANCELLED, RequestObserver
from services.openai_format import Detokenizer, chunk, completion_body, error_body, error_response, sse, usage
from services.pipeline_client import Call, PipelineClient
from services.proto import prism_pb2

log = logging.getLogger("prism.ingress")
api = FastAPI(title="Prism", docs_url=None, redoc_url=None)

_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.FAILED_PRECONDITION,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class IngressDeployment:
    def __init__(
        self,
        config: dict[str, Any],
        media: DeploymentHandle,
        encode: DeploymentHandle,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
    ) -> None:
        self.cfg = PrismConfig.model_validate(config)
        self.frontend = load_frontend(self.cfg.model)
        self.client = PipelineClient(self.cfg, self.frontend, media, encode, prefill, decode)
        self.observer = RequestObserver(self.cfg.observability)
        self.in_flight = 0
        self.observer.metrics.keep_fresh(self._load)

    # ---- admission ----------------------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.in_flight >= self.cfg.server.max_in_flight_per_ingress:
            raise Overloaded("the server is at capacity; retry later", retry_after_s=self.cfg.server.retry_after_s)
        self.in_flight += 1
        self._load()

    def _release(self) -> None:
        self.in_flight -= 1
        self._load()

    def _load(self) -> None:
        self.observer.metrics.load(self.in_flight, self.in_flight)

    def _fail(self, trace: RequestTrace, exc: BaseException) -> PrismError:
        """The typed error for a failure (500 for unexpected ones, logged), with the request finished under it."""
        typed = self.client.as_prism_error(exc)
        if typed is None:
            log.error("request %s failed", trace.request_id, exc_info=exc)
            typed = PrismError("internal error; see the server logs")
        self.observer.finish(trace, typed.http_status, typed.code)
        return typed

    # ---- HTTP ---------------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.client.tenant(_bearer(request))
        except PrismError as exc:
            return error_response(exc)
        card = {
            "id": self.frontend.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "prism",
            "root": str(self.frontend.model_dir),
            "prism_contract": self.frontend.contract.model_dump(),
        }
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        trace = self.observer.start("http")
        traced = self.observer.wants_trace(request.headers.get("x-prism-trace"))
        try:
            self._admit()
        except PrismError as exc:
            return self._error(trace, exc, traced)
        streaming = False
        try:
            try:
                body = await request.json()
            except ValueError:
                raise InvalidRequestError("request body is not valid JSON") from None
            call = await self.client.begin(_bearer(request), body, request.headers.get("x-prism-deadline-ms"), trace)
            if call.req.stream:
                streaming = True
                place = _Place(self, call)
                # Released by whichever ends first: the generator's own cleanup, or Starlette's background task
                # (which also runs when the client left before the generator was ever started).
                return StreamingResponse(
                    self._sse(call, place, traced), media_type="text/event-stream", background=place
                )
            return await self._complete(call, traced)
        except asyncio.CancelledError:  # the client went away (Serve cancels the handler)
            self.observer.finish(trace, *CANCELLED)
            raise
        except Exception as exc:  # every failure becomes an OpenAI error body
            return self._error(trace, exc, traced)
        finally:
            if not streaming:
                self._release()

    def _error(self, trace: RequestTrace, exc: BaseException, traced: bool) -> Response:
        typed = self._fail(trace, exc)
        return error_response(typed, trace.summary() if traced else None)

    async def _complete(self, call: Call, traced: bool) -> Response:
        out_ids, finish = await self.client.collect(call)
        text = visible_text(self.frontend.tokenizer, out_ids, call.sampling)
        body = completion_body(
            call.rid, self.frontend.served_name, text, finish, call.prompt_ids, out_ids, call.req.return_token_ids
        )
        self.observer.finish(call.trace, 200, "ok", call.kv_blocks)
        if traced:
            body["prism_trace"] = call.trace.summary()
        return JSONResponse(body)

    async def _sse(self, call: Call, place: "_Place", traced: bool) -> AsyncIterator[str]:
        rid, model, created = call.rid, self.frontend.served_name, int(time.time())
        detok = Detokenizer(self.frontend.tokenizer, call.sampling)
        out_ids: list[int] = []
        try:
            yield chunk(rid, model, created, {"role": "assistant", "content": ""})
            async for token, finish in self.client.tokens(call):
                out_ids.append(token)
                delta = detok.push(token)
                if finish is None:
                    if delta:
                        yield chunk(rid, model, created, {"content": delta})
                    continue
                extra = {"token_ids": out_ids} if call.req.return_token_ids else {}
                yield chunk(rid, model, created, {"content": delta + detok.finish()}, finish, **extra)
                self.observer.finish(call.trace, 200, "ok", call.kv_blocks)
                final: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created}
                final.update(model=model, choices=[], usage=usage(call.prompt_ids, out_ids))
                if call.req.return_token_ids:
                    final["prompt_token_ids"] = call.prompt_ids
                if traced:
                    final["prism_trace"] = call.trace.summary()
                yield sse(final)
        except Exception as exc:  # mid-stream failure: an error event, then the stream ends cleanly
            typed = self._fail(call.trace, exc)
            yield sse(error_body(typed, call.trace.summary() if traced else None))
        finally:
            place.release()  # client gone or done: cancel the stream (frees the sequence's KV now)
        yield "data: [DONE]\n\n"

    # ---- gRPC (method names are the service's RPCs) -------------------------------------------------------
    async def Generate(self, request: prism_pb2.GenerateRequest, grpc_context) -> prism_pb2.GenerateResponse:
        trace = self.observer.start("grpc")
        traced = self._grpc_traced(grpc_context)
        try:
            self._admit()
        except PrismError as exc:
            raise self._grpc_fail(grpc_context, trace, exc, traced) from None
        try:
            call = await self.client.begin(request.api_key, _json(request), request.deadline_ms, trace)
            out_ids, finish = await self.client.collect(call)
            self.observer.finish(trace, 200, "ok", call.kv_blocks)
            self._grpc_trace(grpc_context, trace, traced)
            return prism_pb2.GenerateResponse(
                id=call.rid,
                text=visible_text(self.frontend.tokenizer, out_ids, call.sampling),
                token_ids=out_ids,
                prompt_token_ids=call.prompt_ids,
                finish_reason=finish,
                usage=prism_pb2.Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=len(out_ids)),
            )
        except Exception as exc:
            raise self._grpc_fail(grpc_context, trace, exc, traced) from None
        finally:
            self.observer.finish(trace, *CANCELLED)  # no-op unless the call was cancelled
            self._release()

    async def GenerateStream(self, request: prism_pb2.GenerateRequest, grpc_context):
        trace = self.observer.start("grpc")
        traced = self._grpc_traced(grpc_context)
        try:
            self._admit()
        except PrismError as exc:
            raise self._grpc_fail(grpc_context, trace, exc, traced) from None
        call = None
        try:
            call = await self.client.begin(request.api_key, _json(request), request.deadline_ms, trace)
            detok = Detokenizer(self.frontend.tokenizer, call.sampling)
            out_ids: list[int] = []
            async for token, finish in self.client.tokens(call):
                out_ids.append(token)
                delta = detok.push(token) + (detok.finish() if finish else "")
                usage_msg = None
                if finish:
                    usage_msg = prism_pb2.Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=len(out_ids))
                    self.observer.finish(trace, 200, "ok", call.kv_blocks)
                    self._grpc_trace(grpc_context, trace, traced)
                yield prism_pb2.GenerateChunk(
                    id=call.rid, delta=delta, token_id=token, finish_reason=finish or "", usage=usage_msg
                )
        except Exception as exc:
            raise self._grpc_fail(grpc_context, trace, exc, traced) from None
        finally:
            if call is not None:
                call.stream.cancel()
            self.observer.finish(trace, *CANCELLED)  # no-op unless the call was cancelled
            self._release()

    def _grpc_traced(self, grpc_context) -> bool:
        metadata = dict(grpc_context.invocation_metadata() or ())
        return self.observer.wants_trace(metadata.get("x-prism-trace"))

    def _grpc_fail(self, grpc_context, trace: RequestTrace, exc: BaseException, traced: bool) -> "GrpcAbort":
        """Finish the request under its typed error, set the status (and trace), and return what to raise."""
        error = _grpc_error(grpc_context, self._fail(trace, exc))
        self._grpc_trace(grpc_context, trace, traced)
        return error

    def _grpc_trace(self, grpc_context, trace: RequestTrace, traced: bool) -> None:
        """gRPC has no body to extend: the trace travels as the ``prism-trace`` trailing metadata (JSON)."""
        if traced:
            grpc_context.set_trailing_metadata([("prism-trace", json.dumps(trace.summary(), separators=(",", ":")))])


class _Place:
    """One streaming request's place in the ingress's in-flight count and its decode stream, released exactly once
    (cancelling the stream frees the sequence's KV even if the response generator never ran)."""

    def __init__(self, ingress: IngressDeployment, call: Call) -> None:
        self.ingress, self.call, self.done = ingress, call, False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.call.stream.cancel()
            self.ingress._release()
            self.ingress.observer.finish(self.call.trace, *CANCELLED)  # no-op when the stream already finished

    async def __call__(self) -> None:
        self.release()


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _json(request: prism_pb2.GenerateRequest) -> Any:
    try:
        return json.loads(request.chat_completion_json)
    except ValueError:
        raise InvalidRequestError("chat_completion_json is not valid JSON") from None


class GrpcAbort(Exception):
    """Raised after setting a status on the gRPC context: Serve turns it into that status for the client."""


def _grpc_error(context, exc: PrismError) -> GrpcAbort:
    context.set_code(_GRPC_CODES.get(exc.http_status, grpc.StatusCode.INTERNAL))
    context.set_details(json.dumps(exc.to_body()))
    return GrpcAbort(exc.message)


# FastAPI's class-based view rewrite must happen at import time in every process (replicas re-import this module;
# a rewrite done only in the driver would be lost), so the ASGI wrapper is made here, not in the app builder.
IngressApp = serve.ingress(api)(IngressDeployment)
