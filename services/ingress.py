"""Ingress deployment: the OpenAI-compatible HTTP API.

Per request: authenticate (API key → tenant), validate the body and the pre-fetch media limits (400s cost nothing
downstream), fix the absolute deadline (``X-Prism-Deadline-Ms`` or the default), then chain the stages through Serve
handles — media → encode → prefill → decode — passing each stage's *response* to the next, so pixels, embeddings and
KV go replica to replica through the object store and never through this process. Only the decode stream (token ids)
comes back here to be detokenized.

Failures map to OpenAI-style error bodies: the stages' typed errors keep their status; a full downstream queue
(Serve ``BackPressureError``) is 429 + Retry-After; the deadline passing is 504 ``deadline_exceeded``. A client that
disconnects cancels the decode stream, and Serve propagates the cancellation to the stages still working for it.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.config import PrismConfig
from common.errors import (
    AuthenticationError,
    DeadlineExceeded,
    InvalidRequestError,
    ModelNotFound,
    Overloaded,
    PrismError,
)
from common.media.loader import check_request
from common.model.loader import load_frontend
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from services.openai_format import Detokenizer, chunk, completion_body, error_response, sse, usage

log = logging.getLogger("prism.ingress")
api = FastAPI(title="Prism", docs_url=None, redoc_url=None)


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
        self.media, self.encode, self.prefill, self.decode = media, encode, prefill, decode
        self.in_flight = 0

    # ---- small endpoints ------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
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

    # ---- chat completions -----------------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        if self.in_flight >= self.cfg.server.max_in_flight_per_ingress:
            return error_response(
                Overloaded("the server is at capacity; retry later", retry_after_s=self.cfg.server.retry_after_s)
            )
        self.in_flight += 1
        try:
            response = await self._chat(request)
        except BaseException:
            self.in_flight -= 1
            raise
        if isinstance(response, StreamingResponse):  # the stream holds its place until it ends
            response.background = _Release(self)
        else:
            self.in_flight -= 1
        return response

    async def _chat(self, request: Request) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            tenant = self._tenant(request)
            req = parse_chat_request(await self._json(request))
            if req.model != self.frontend.served_name:
                raise ModelNotFound(f"model {req.model!r} is not served here; try {self.frontend.served_name!r}")
            deadline = self._deadline(request)
            sampling = req.sampling(self.cfg.engine.max_output_tokens).resolved()
            if sampling.max_tokens > self.cfg.engine.max_output_tokens:
                raise InvalidRequestError(
                    f"max_tokens is {sampling.max_tokens}; the limit is {self.cfg.engine.max_output_tokens}",
                    param="max_tokens",
                )
            check_request(req.media_refs(), self.cfg.media)
            stream = self._start(req, sampling, rid, tenant, deadline)
            first = await self._next(stream, deadline)  # the prompt ids: every stage's error surfaces here
        except Exception as exc:  # every failure becomes an OpenAI error body
            return self._error(exc, rid)
        prompt_ids = first["prompt_token_ids"]
        if req.stream:
            return StreamingResponse(
                self._sse(stream, req, sampling, rid, prompt_ids, deadline), media_type="text/event-stream"
            )
        return await self._complete(stream, req, sampling, rid, prompt_ids, deadline)

    def _start(
        self, req: ChatCompletionRequest, sampling: SamplingParams, rid: str, tenant: str, deadline: float
    ) -> DeploymentResponseGenerator:
        refs = req.media_refs()
        embeddings: Any = []
        if refs:
            media = self.media.process.remote(refs, tenant, deadline)
            embeddings = self.encode.encode.remote(media, rid, tenant, deadline)
        pre = self.prefill.prefill.remote(req.template_messages(), embeddings, sampling, rid, tenant, deadline)
        return self.decode.generate.options(stream=True).remote(pre, sampling, rid, deadline)

    async def _next(self, stream: DeploymentResponseGenerator, deadline: float) -> dict[str, Any]:
        left = deadline - time.time()
        if left <= 0:
            stream.cancel()
            raise DeadlineExceeded("deadline exceeded")
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout=left)
        except TimeoutError:
            stream.cancel()
            raise DeadlineExceeded("deadline exceeded while the request was in flight") from None
        except StopAsyncIteration:
            raise PrismError("decode stream ended unexpectedly") from None

    async def _complete(self, stream, req, sampling, rid, prompt_ids, deadline) -> Response:
        detok = Detokenizer(self.frontend.tokenizer, sampling)
        out_ids: list[int] = []
        finish = None
        try:
            while finish is None:
                event = await self._next(stream, deadline)
                finish = event["finish_reason"]
                if event["token_id"] is not None:
                    out_ids.append(event["token_id"])
                    detok.push(event["token_id"])
            if finish == "timeout":
                raise DeadlineExceeded("deadline exceeded during decode")
            if finish == "error":
                raise PrismError("decode failed")
        except Exception as exc:  # every failure becomes an OpenAI error body
            return self._error(exc, rid)
        finally:
            stream.cancel()
        body = completion_body(
            rid, self.frontend.served_name, detok.text(), finish, prompt_ids, out_ids, req.return_token_ids
        )
        return JSONResponse(body)

    async def _sse(self, stream, req, sampling, rid, prompt_ids, deadline) -> AsyncIterator[str]:
        model, created = self.frontend.served_name, int(time.time())
        detok = Detokenizer(self.frontend.tokenizer, sampling)
        out_ids: list[int] = []
        try:
            yield chunk(rid, model, created, {"role": "assistant", "content": ""})
            while True:
                event = await self._next(stream, deadline)
                finish = event["finish_reason"]
                if finish in ("timeout", "error"):
                    code = DeadlineExceeded if finish == "timeout" else PrismError
                    yield sse(code(f"request {finish} during decode").to_body())
                    break
                out_ids.append(event["token_id"])
                delta = detok.push(event["token_id"])
                if finish is not None:
                    delta += detok.finish()
                    extra = {"token_ids": out_ids} if req.return_token_ids else {}
                    yield chunk(rid, model, created, {"content": delta}, finish, **extra)
                    final: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created}
                    final.update(model=model, choices=[], usage=usage(prompt_ids, out_ids))
                    if req.return_token_ids:
                        final["prompt_token_ids"] = prompt_ids
                    yield sse(final)
                    break
                if delta:
                    yield chunk(rid, model, created, {"content": delta})
        except PrismError as exc:
            yield sse(exc.to_body())
        finally:
            stream.cancel()  # client gone or done: free the sequence's KV now
        yield "data: [DONE]\n\n"

    # ---- request plumbing -----------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        keys = self.cfg.server.api_keys
        if not keys:
            return "default"
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in keys:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>)")
        return keys[key]

    async def _json(self, request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            raise InvalidRequestError("request body is not valid JSON") from None

    def _deadline(self, request: Request) -> float:
        server = self.cfg.server
        raw = request.headers.get("x-prism-deadline-ms")
        budget = server.default_deadline_ms
        if raw is not None:
            if not raw.strip().isdigit() or int(raw) < 1:
                raise InvalidRequestError("X-Prism-Deadline-Ms must be a positive integer", param="X-Prism-Deadline-Ms")
            budget = int(raw)
            if budget > server.max_deadline_ms:
                raise InvalidRequestError(
                    f"X-Prism-Deadline-Ms is {budget}; the limit is {server.max_deadline_ms}",
                    param="X-Prism-Deadline-Ms",
                )
        return time.time() + budget / 1000.0

    def _error(self, exc: BaseException, rid: str) -> Response:
        if isinstance(exc, PrismError):
            return error_response(exc)
        if isinstance(exc, BackPressureError):
            return error_response(
                Overloaded("a stage is at capacity; retry later", retry_after_s=self.cfg.server.retry_after_s)
            )
        log.exception("request %s failed", rid)
        return error_response(PrismError("internal error; see server logs for request " + rid))


class _Release:
    """Background task of a streaming response: gives the ingress place back when the stream ends (either way)."""

    def __init__(self, ingress: IngressDeployment) -> None:
        self.ingress = ingress

    async def __call__(self) -> None:
        self.ingress.in_flight -= 1


# FastAPI's class-based view rewrite must happen at import time in every process (replicas re-import this module;
# a rewrite done only in the driver would be lost), so the ASGI wrapper is made here, not in the app builder.
IngressApp = serve.ingress(api)(IngressDeployment)
