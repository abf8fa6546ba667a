"""What the ingress does for one request to one served model, whatever the protocol (HTTP or gRPC).

One client per served model: the ingress picks it by the request's ``model`` after :mod:`services.auth` has
authenticated the request from its headers. :meth:`PipelineClient.begin` validates the OpenAI body and the pre-fetch
media limits (400s that cost nothing downstream), fixes the absolute deadline, and chains the model's stages through
Serve handles — media → encode → prefill → decode — passing each stage's *response* to the next, so pixels,
embeddings and KV go replica to replica through the object store (or NIXL) and never through the ingress. It waits
for the decode stream's :class:`StreamStart` (the prompt's token ids), so every stage's error surfaces before a
protocol commits to a status; a chain that lost a replica before that point is issued again (bounded, jittered —
:mod:`services.retry`) under a new attempt number. :meth:`PipelineClient.tokens` then yields
``(token_id, finish_reason)`` from the typed decode events under the deadline.

Each attempt carries one :class:`RequestContext` (id, attempt, tenant, deadline, priority, ``sent_at``) to every
stage. Every call carries a :class:`RequestTrace`: the ingress span closes when the chain is issued (the context's
``sent_at``), the stages' spans arrive with the stream's start event and first token, and every token is stamped as
it arrives here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from common.config import PrismConfig
from common.errors import (
    DeadlineExceeded,
    HandoffError,
    InvalidRequestError,
    PrismError,
)
from common.media.loader import check_request
from common.model.loader import ModelFrontend
from common.obs.request_trace import RequestTrace
from common.protocol.body import ascii_int
from common.protocol.handoff import DecodeEvent, RequestContext, StreamAbort, StreamStart, StreamToken
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from common.stages.prompt import render_chat
from services.lifecycle import REPLICA_LOST
from services.retry import with_retries


@dataclass
class Call:
    ctx: RequestContext
    """The context of the attempt whose chain answered."""
    frontend: ModelFrontend
    """The model it runs on (tokenizer for the text, served name)."""
    req: ChatCompletionRequest
    sampling: SamplingParams
    stream: DeploymentResponseGenerator
    prompt_ids: list[int]
    trace: RequestTrace
    kv_blocks: int = 0

    @property
    def rid(self) -> str:
        return self.ctx.request_id


class PipelineClient:
    def __init__(self, cfg: PrismConfig, frontend: ModelFrontend, media, encode, prefill, decode) -> None:
        self.cfg = cfg
        self.frontend = frontend
        self.media: DeploymentHandle = media
        self.encode: DeploymentHandle = encode
        self.prefill: DeploymentHandle = prefill
        self.decode: DeploymentHandle = decode

    def deadline(self, budget_ms: str | int | None) -> float:
        server = self.cfg.server
        budget = server.default_deadline_ms
        if budget_ms not in (None, "", 0):
            parsed = ascii_int(str(budget_ms), max_digits=12)
            if parsed is None or parsed < 1:
                raise InvalidRequestError("X-Prism-Deadline-Ms must be a positive integer", param="X-Prism-Deadline-Ms")
            budget = parsed
            if budget > server.max_deadline_ms:
                raise InvalidRequestError(
                    f"X-Prism-Deadline-Ms is {budget}; the limit is {server.max_deadline_ms}",
                    param="X-Prism-Deadline-Ms",
                )
        return time.time() + budget / 1000.0

    async def begin(self, tenant: str, body: Any, budget_ms: str | int | None, trace: RequestTrace) -> Call:
        """Validate the decoded body for an authenticated ``tenant`` and issue the chain; returns once decode has
        started. Every check here is a 4xx that costs milliseconds: counts and parameters, the media references, and
        the prompt's text tokens (rendered and tokenised in a worker thread, never on the event loop)."""
        trace.tenant = tenant
        req = parse_chat_request(body, self.cfg.server)  # (the ingress picked this client by the body's `model`)
        deadline = self.deadline(budget_ms)
        sampling = req.sampling(self.cfg.engine.max_output_tokens).resolved()
        if sampling.max_tokens > self.cfg.engine.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {sampling.max_tokens}; the limit is {self.cfg.engine.max_output_tokens}",
                param="max_tokens",
            )
        refs = req.media_refs()
        check_request(refs, self.cfg.media)
        await asyncio.to_thread(self._check_text_tokens, req, len(refs))
        ignored = {"ignored_fields": req.ignored_fields} if req.ignored_fields else {}
        trace.sent(media_items=len(refs), max_tokens=sampling.max_tokens, **ignored)
        attempts = itertools.count(1)

        def context() -> RequestContext:
            n = next(attempts)  # a re-issued chain's stages count their queue from its own issue time
            sent_at = trace.timeline.last if n == 1 else time.time()
            return RequestContext(trace.request_id, tenant, deadline, sent_at, attempt=n)

        stream, ctx, first = await with_retries(
            lambda: self._attempt(req, sampling, context()),
            deadline,
            REPLICA_LOST,
            max_attempts=self.cfg.server.max_chain_attempts,
        )
        trace.absorb(first.spans)
        trace.prompt_tokens = len(first.prompt_token_ids)
        return Call(ctx, self.frontend, req, sampling, stream, list(first.prompt_token_ids), trace)

    def _check_text_tokens(self, req: ChatCompletionRequest, media_items: int) -> None:
        """The prompt rendered with one placeholder per media item: a lower bound of its final length (each item
        expands to at least one visual token), so over ``max_prompt_tokens`` here is over it for certain."""
        limit = self.cfg.engine.max_prompt_tokens
        n = len(self.frontend.tokenizer(render_chat(self.frontend, req.template_messages()))["input_ids"])
        if n > limit:
            what = "tokens" if not media_items else f"tokens before its {media_items} media items are expanded"
            raise InvalidRequestError(
                f"prompt is {n} {what}; the limit is {limit}", code="prompt_too_long", param="messages"
            )

    async def _attempt(
        self, req: ChatCompletionRequest, sampling: SamplingParams, ctx: RequestContext
    ) -> tuple[DeploymentResponseGenerator, RequestContext, StreamStart]:
        """Issue the whole chain (each stage's response passed to the next) and wait for the decode stream's start;
        a failed attempt cancels its chain."""
        refs = req.media_refs()
        embeddings: Any = []
        if refs:
            media = self.media.process.remote(refs, ctx)
            embeddings = self.encode.encode.remote(media, ctx)
        pre = self.prefill.prefill.remote(req.template_messages(), embeddings, sampling, ctx)
        stream = self.decode.generate.options(stream=True).remote(pre, sampling, ctx)
        try:
            first = await self._next(stream, ctx.deadline)
            if not isinstance(first, StreamStart):
                raise HandoffError(f"the decode stream began with {type(first).__name__}, not its start")
            return stream, ctx, first
        except BaseException:
            stream.cancel()
            raise

    async def tokens(self, call: Call) -> AsyncIterator[tuple[int, str | None]]:
        """``(token_id, finish_reason)`` until the sequence finishes; raises 504 / 500 on timeout / failure."""
        while True:
            event = await self._next(call.stream, call.ctx.deadline)
            if isinstance(event, StreamAbort):
                if event.reason == "timeout":
                    raise DeadlineExceeded("deadline exceeded during decode")
                raise PrismError("decode failed; see the decode replica's log")
            if not isinstance(event, StreamToken):
                raise HandoffError(f"the decode stream sent {type(event).__name__} where a token was due")
            call.trace.absorb(event.spans)
            call.trace.token()
            if event.finish_reason is not None:
                call.kv_blocks = event.kv_blocks
            yield event.token_id, event.finish_reason
            if event.finish_reason is not None:
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

    async def _next(self, stream: DeploymentResponseGenerator, deadline: float) -> DecodeEvent:
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
