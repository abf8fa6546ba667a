"""What the ingress does for one request, whatever the protocol (HTTP or gRPC).

:meth:`PipelineClient.begin` authenticates (API key → tenant), validates the OpenAI body and the pre-fetch media
limits (400s that cost nothing downstream), fixes the absolute deadline, and chains the stages through Serve handles —
media → encode → prefill → decode — passing each stage's *response* to the next, so pixels, embeddings and KV go
replica to replica through the object store (or NIXL) and never through the ingress. It waits for the decode
stream's first item (the prompt's token ids), so every stage's error surfaces before a protocol commits to a
status; a chain that lost a replica before that point is restarted (bounded, jittered — :mod:`services.retry`).
:meth:`PipelineClient.tokens` then yields ``(token_id, finish_reason)`` under the deadline.

Every call carries a :class:`RequestTrace`: the ingress span closes when the chain is issued (each stage gets that
moment as ``sent_at``), the stages' spans arrive with the decode stream's first item and first token, and every token
is stamped as it arrives here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from common.config import PrismConfig
from common.errors import (
    AuthenticationError,
    DeadlineExceeded,
    InvalidRequestError,
    ModelNotFound,
    Overloaded,
    PrismError,
    StageUnavailable,
)
from common.media.loader import check_request
from common.model.loader import ModelFrontend
from common.obs.request_trace import RequestTrace
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from services.retry import with_retries

_REPLICA_LOST = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)


@dataclass
class Call:
    rid: str
    req: ChatCompletionRequest
    sampling: SamplingParams
    stream: DeploymentResponseGenerator
    prompt_ids: list[int]
    deadline: float
    trace: RequestTrace
    kv_blocks: int = 0


class PipelineClient:
    def __init__(self, cfg: PrismConfig, frontend: ModelFrontend, media, encode, prefill, decode) -> None:
        self.cfg = cfg
        self.frontend = frontend
        self.media: DeploymentHandle = media
        self.encode: DeploymentHandle = encode
        self.prefill: DeploymentHandle = prefill
        self.decode: DeploymentHandle = decode
        self.keys = cfg.server.load_api_keys()

    def tenant(self, api_key: str | None) -> str:
        keys = self.keys
        if not keys:
            return "default"
        if not api_key or api_key not in keys:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>)")
        return keys[api_key]

    def deadline(self, budget_ms: str | int | None) -> float:
        server = self.cfg.server
        budget = server.default_deadline_ms
        if budget_ms not in (None, "", 0):
            text = str(budget_ms).strip()
            if not text.isdigit() or int(text) < 1:
                raise InvalidRequestError("X-Prism-Deadline-Ms must be a positive integer", param="X-Prism-Deadline-Ms")
            budget = int(text)
            if budget > server.max_deadline_ms:
                raise InvalidRequestError(
                    f"X-Prism-Deadline-Ms is {budget}; the limit is {server.max_deadline_ms}",
                    param="X-Prism-Deadline-Ms",
                )
        return time.time() + budget / 1000.0

    async def begin(self, api_key: str | None, body: Any, budget_ms: str | int | None, trace: RequestTrace) -> Call:
        rid = trace.request_id
        tenant = trace.tenant = self.tenant(api_key)
        req = parse_chat_request(body)
        if req.model != self.frontend.served_name:
            raise ModelNotFound(f"model {req.model!r} is not served here; try {self.frontend.served_name!r}")
        deadline = self.deadline(budget_ms)
        sampling = req.sampling(self.cfg.engine.max_output_tokens).resolved()
        if sampling.max_tokens > self.cfg.engine.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {sampling.max_tokens}; the limit is {self.cfg.engine.max_output_tokens}",
                param="max_tokens",
            )
        check_request(req.media_refs(), self.cfg.media)
        trace.sent(media_items=len(req.media_refs()), max_tokens=sampling.max_tokens)
        try:
            stream, first = await with_retries(
                lambda: self._attempt(req, sampling, rid, tenant, deadline, trace.timeline.last),
                deadline,
                _REPLICA_LOST,
                max_attempts=self.cfg.server.max_chain_attempts,
            )
        except BackPressureError:
            raise Overloaded(
                "a stage is at capacity; retry later", retry_after_s=self.cfg.server.retry_after_s
            ) from None
        trace.absorb(first.get("spans", ()))
        trace.prompt_tokens = len(first["prompt_token_ids"])
        return Call(rid, req, sampling, stream, first["prompt_token_ids"], deadline, trace)

    async def _attempt(
        self,
        req: ChatCompletionRequest,
        sampling: SamplingParams,
        rid: str,
        tenant: str,
        deadline: float,
        sent_at: float,
    ) -> tuple[DeploymentResponseGenerator, dict[str, Any]]:
        """Issue the whole chain (each stage's response passed to the next) and wait for the decode stream's first
        item; a failed attempt cancels its chain."""
        refs = req.media_refs()
        embeddings: Any = []
        if refs:
            media = self.media.process.remote(refs, tenant, deadline, sent_at)
            embeddings = self.encode.encode.remote(media, rid, tenant, deadline, sent_at)
        pre = self.prefill.prefill.remote(req.template_messages(), embeddings, sampling, rid, tenant, deadline, sent_at)
        stream = self.decode.generate.options(stream=True).remote(pre, sampling, rid, deadline, sent_at)
        try:
            return stream, await self._next(stream, deadline)
        except BaseException:
            stream.cancel()
            raise

    async def tokens(self, call: Call) -> AsyncIterator[tuple[int, str | None]]:
        """``(token_id, finish_reason)`` until the sequence finishes; raises 504 / 500 on timeout / failure."""
        while True:
            event = await self._next(call.stream, call.deadline)
            finish = event["finish_reason"]
            if finish == "timeout":
                raise DeadlineExceeded("deadline exceeded during decode")
            if finish == "error":
                raise PrismError("decode failed")
            call.trace.absorb(event.get("spans", ()))
            call.trace.token()
            call.kv_blocks = event.get("kv_blocks", call.kv_blocks)
            yield event["token_id"], finish
            if finish is not None:
                return

    async def collect(self, call: Call) -> tuple[list[int], str]:
        """Every token of a non-streaming call and its finish reason; the stream is closed either way."""
        out: list[int] = []
        finish: str | None = None
        try:
            async for token, reason in self.tokens(call):
                out.append(token)
                finish = reason
        finally:
            call.stream.cancel()
        return out, finish or "stop"

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

    def as_prism_error(self, exc: BaseException) -> PrismError | None:
        """The typed error a failure maps to; ``None`` for unexpected failures (500, logged by the caller)."""
        if isinstance(exc, PrismError):
            return exc
        if isinstance(exc, BackPressureError):
            return Overloaded("a stage is at capacity; retry later", retry_after_s=self.cfg.server.retry_after_s)
        if isinstance(exc, _REPLICA_LOST):
            return StageUnavailable(
                "a stage replica failed while serving this request; retry", retry_after_s=self.cfg.server.retry_after_s
            )
        return None
