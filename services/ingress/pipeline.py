"""What the ingress does for one request to one served model, whatever the protocol (HTTP or gRPC).

One client per served model: the ingress picks it by the request's ``model`` after :mod:`common.auth` has
authenticated the request from its headers. :meth:`PipelineClient.begin` validates the OpenAI body and the pre-fetch
media limits (400s that cost nothing downstream), fixes the absolute deadline, and chains the model's stages through
Serve handles — media → encode → prefill → decode — passing each stage's *response* to the next, so pixels,
embeddings and KV go replica to replica through the object store (or NIXL) and never through the ingress. It waits
for the decode stream's :class:`StreamStart` (the prompt's token ids), so every stage's error surfaces before a
protocol commits to a status; a chain that lost a replica before that point is issued again (bounded, jittered —
:mod:`services.ingress.retry`) under a new attempt number. The :class:`services.ingress.call_stream.Call` it returns is
read by :meth:`PipelineClient.tokens` / :meth:`PipelineClient.collect`
(:class:`services.ingress.call_stream.CallStream`: the typed decode events under the deadline, and decode migration when
the decode replica is lost mid-stream).

Admission at the ingress, in the order the costs appear (:mod:`common.sched`): the body's counts and parameters, then
the prompt's text tokens (the request's :class:`ResourceVector` as far as the ingress can know it — complete for a
text-only request, whose prompt and KV limits are checked here), then the tenant's quota (429
``tenant_quota_exceeded``). The quota's ticket is charged the media stage's pixels, patches and visual tokens when
they reach the ingress with the stream's start, and released when the request closes, however it closes.

**KV before prefill.** Each attempt reserves the request's decode KV before it issues prefill (media and encode run
meanwhile): :mod:`services.ingress.kv_reserver`. The reserving replica is named in the attempt's context, where the
decode router sends ``generate``; an attempt that fails before its stream claimed the reservation gives it back.

Each attempt carries one :class:`RequestContext` (id, attempt, tenant, deadline, priority, ``sent_at``, the vector)
to every stage, and the client keeps every stage response of the attempt: a failed attempt, a 504 or a client gone
cancels the whole chain (media, encode, prefill, decode), not only the decode stream.

Every call carries a :class:`RequestTrace`: the ingress span closes when the chain is issued (the context's
``sent_at``), the stages' spans arrive with the stream's start event and first token (with where the encode and
prefill routers sent the calls, by the :class:`RouteKeys` made here), and every token is stamped as it arrives here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ray.serve.handle import DeploymentHandle

from common.admission.limits import check_limits
from common.admission.quota import TenantQuotas, Ticket
from common.cache.scope import cache_scope
from common.config import PrismConfig
from common.errors import HandoffError, InvalidRequestError, PrismError
from common.media.loader import check_request
from common.model.loader import ModelFrontend
from common.obs.request_trace import RequestTrace
from common.obs.trace import Span, Traced
from common.protocol.body import ascii_int
from common.protocol.handoff import Priority, RequestContext, RouteKeys, StreamStart
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from common.protocol.vector import ResourceVector
from common.sched.affinity import media_key, prefix_key
from common.stages.prompt import render_chat
from services.ingress.call_stream import Call, CallStream, cancel_chain, next_event
from services.ingress.failures import REPLICA_LOST
from services.ingress.kv_reserver import KVReserver
from services.ingress.retry import with_retries
from services.routers import route_log


class PipelineClient:
    def __init__(
        self,
        cfg: PrismConfig,
        frontend: ModelFrontend,
        media,
        encode,
        prefill,
        decode,
        quotas: TenantQuotas | None = None,
        metrics: Any = None,
    ) -> None:
        """``metrics``: the ingress's :class:`services.platform.metrics.Metrics` (admission decisions are counted
        there)."""
        self.cfg = cfg
        self.frontend = frontend
        self.quotas = quotas or TenantQuotas(cfg.admission, retry_after_s=cfg.server.retry_after_s)
        self.metrics = metrics
        self.media: DeploymentHandle = media
        self.encode: DeploymentHandle = encode
        self.prefill: DeploymentHandle = prefill
        self.decode: DeploymentHandle = decode
        self.kv = KVReserver(cfg, frontend, decode)
        self.streams = CallStream(cfg.server.max_migrations, self._count_migration)

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

    async def begin(
        self,
        tenant: str,
        body: Any,
        budget_ms: str | int | None,
        trace: RequestTrace,
        priority_header: str | None = None,
    ) -> Call:
        """Validate the decoded body for an authenticated ``tenant``, admit it and issue the chain; returns once
        decode has started. Every check here is a 4xx/429 that costs milliseconds: counts and parameters, the media
        references, the prompt's text tokens (rendered and tokenised in a worker thread, never on the event loop),
        the per-request limits the ingress can already judge, and the tenant's quota."""
        trace.tenant = tenant
        req = parse_chat_request(body, self.cfg.server)  # (the ingress picked this client by the body's `model`)
        priority = _priority(req, priority_header)
        deadline = self.deadline(budget_ms)
        sampling = req.sampling(self.cfg.engine.max_output_tokens).resolved()
        if sampling.max_tokens > self.cfg.engine.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {sampling.max_tokens}; the limit is {self.cfg.engine.max_output_tokens}",
                param="max_tokens",
            )
        refs = req.media_refs()
        check_request(refs, self.cfg.media)
        rendered, route = await asyncio.to_thread(self._tokens_and_route, req, tenant)
        data_bytes = sum(len(r.url) * 3 // 4 for r in refs if r.url[:5].lower() == "data:")
        vector = ResourceVector.at_ingress(
            rendered, len(refs), sampling.max_tokens, self.cfg.engine.kv_block_size, media_bytes=data_bytes
        )
        ticket = self._admit(tenant, priority, vector)
        chain = None
        try:
            ignored = {"ignored_fields": req.ignored_fields} if req.ignored_fields else {}
            trace.sent(media_items=len(refs), max_tokens=sampling.max_tokens, priority=priority, **ignored)
            attempts = itertools.count(1)

            def context() -> RequestContext:
                n = next(attempts)  # a re-issued chain's stages count their queue from its own issue time
                sent_at = trace.timeline.last if n == 1 else time.time()
                return RequestContext(
                    trace.request_id,
                    tenant,
                    deadline,
                    sent_at,
                    attempt=n,
                    priority=priority,
                    vector=vector,
                    route=route,
                )

            kv_blocks = self.kv.estimate(refs, vector)

            def issue(replay: tuple[int, ...] = ()) -> Awaitable[tuple[list[Any], RequestContext, StreamStart]]:
                return with_retries(
                    lambda: self._attempt(req, sampling, context(), replay, kv_blocks),
                    deadline,
                    REPLICA_LOST,
                    max_attempts=self.cfg.server.max_chain_attempts,
                )

            chain, ctx, first = await issue()
            trace.absorb(first.spans)
            for stage in ("encode", "prefill"):
                decision = route_log.take(stage, ctx.key)
                if decision is not None:
                    trace.route(stage, **decision)
            if ctx.decode_replica is not None:
                trace.route("decode", ctx.reservation, ctx.decode_replica)
            trace.prompt_tokens = len(first.prompt_token_ids)
            self._charge_media(ticket, vector, first.spans)
        except BaseException:
            self.quotas.release(ticket)
            if chain is not None:
                cancel_chain(chain)
            raise
        return Call(
            ctx,
            self.frontend,
            req,
            sampling,
            chain[-1],
            list(first.prompt_token_ids),
            trace,
            chain,
            lambda: self.quotas.release(ticket),
            issue,
        )

    def _admit(self, tenant: str, priority: Priority, vector: ResourceVector) -> Ticket:
        """Per-request limits (complete for a text-only request; for one with media the vector is a lower bound, so
        over a limit here is over it for certain), then the tenant's quota; each decision counted."""
        reason = "limit"
        try:
            eng = self.cfg.engine
            check_limits(vector, self.cfg.admission, eng.max_prompt_tokens, eng.max_lease_blocks)
            reason = "quota"
            ticket = self.quotas.admit(tenant, vector)
        except PrismError:
            self._count(tenant, priority, "refused", reason)
            raise
        self._count(tenant, priority, "admitted", "immediate")
        return ticket

    def _count(self, tenant: str, priority: str, result: str, reason: str) -> None:
        if self.metrics is not None:
            count_admission(self.metrics, tenant, priority, result, reason)

    def _count_migration(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("prism_migrations_total", outcome=outcome)

    def _tokens_and_route(self, req: ChatCompletionRequest, tenant: str) -> tuple[int, RouteKeys | None]:
        """Tokens of the prompt rendered with one placeholder per media item (each expands to its visual tokens in
        the media stage's count), and the request's cache-affinity keys (:mod:`common.sched.affinity`)."""
        ids = self.frontend.tokenizer(render_chat(self.frontend, req.template_messages()))["input_ids"]
        routing = self.cfg.routing
        if not routing.affinity:
            return len(ids), None
        scope = cache_scope(tenant, self.cfg.engine.shared_cache_scope)
        media = [media_key(scope, ref.url) for ref in req.media_refs()]
        placeholders = frozenset(self.frontend.placeholder_id(m) for m in self.frontend.adapter.modalities)
        prefix = prefix_key(scope, ids, placeholders, media, routing.prefix_key_tokens)
        return len(ids), RouteKeys(media=media[0] if media else None, prefix=prefix)

    def _charge_media(self, ticket: Ticket, vector: ResourceVector, spans: tuple[Span, ...]) -> None:
        """Charge the tenant what the media stage measured (pixels, patches, visual tokens beyond the lower bound)."""
        for span in spans:
            if span.name == "media.process":
                attrs = span.attrs
                visual = int(attrs.get("visual_tokens", 0))
                self.quotas.charge(
                    ticket,
                    pixels=float(attrs.get("pixels", 0)),
                    patches=float(attrs.get("patches", 0)),
                    prompt_tokens=float(max(0, visual - vector.visual_tokens)),
                )
                return

    async def _attempt(
        self,
        req: ChatCompletionRequest,
        sampling: SamplingParams,
        ctx: RequestContext,
        replay: tuple[int, ...] = (),
        kv_blocks: int = 0,
    ) -> tuple[list[Any], RequestContext, StreamStart]:
        """Issue the whole chain (each stage's response passed to the next) and wait for the decode stream's start;
        a failed attempt cancels every response of its chain. ``replay``: tokens already sent (a migration);
        ``kv_blocks``: what to reserve on a decode replica before prefill (0: nothing)."""
        refs = req.media_refs()
        chain: list[Any] = []
        embeddings: Any = []
        reserved = False
        try:
            if refs:
                media = self.media.process.remote(refs, ctx)
                embeddings = self.encode.encode.remote(media, ctx)
                chain += [media, embeddings]
            ctx, reserved = await self.kv.reserve(ctx, kv_blocks, bool(replay))  # (meanwhile media and encode work)
            if reserved and not refs:  # prefill's timeline starts after the reservation, which the trace shows
                now = time.time()
                waited = Span("decode.reserve", ctx.sent_at, max(0.0, now - ctx.sent_at), {"blocks": kv_blocks})
                embeddings = Traced([], (waited,), now)
            pre = self.prefill.prefill.remote(req.template_messages(), embeddings, sampling, ctx)
            stream = self.decode.generate.options(stream=True).remote(pre, sampling, ctx, replay)
            chain += [pre, stream]
            first = await next_event(stream, ctx.deadline)
            if not isinstance(first, StreamStart):
                raise HandoffError(f"the decode stream began with {type(first).__name__}, not its start")
            return chain, ctx, first
        except BaseException:
            cancel_chain(chain)
            if reserved:  # a reservation no generate may claim now (one already claimed is the stream's to free)
                self.kv.give_back(ctx)
            raise

    def tokens(self, call: Call) -> AsyncIterator[tuple[int, str | None]]:
        """``(token_id, finish_reason)`` of a started call (:meth:`services.ingress.call_stream.CallStream.tokens`)."""
        return self.streams.tokens(call)

    async def collect(self, call: Call) -> tuple[list[int], str]:
        """Every token of a non-streaming call and its finish reason (:meth:`CallStream.collect`)."""
        return await self.streams.collect(call)


def count_admission(metrics: Any, tenant: str, priority: str, result: str, reason: str) -> None:
    """One ingress admission decision in ``prism_admission_total``."""
    tags = {"stage": "ingress", "tenant": tenant, "class": priority, "result": result, "reason": reason}
    metrics.inc("prism_admission_total", **tags)


def header_priority(header: str | None) -> Priority:
    """``X-Prism-Priority`` (interactive when absent); 400 when it is neither class."""
    if header in (None, ""):
        return "interactive"
    value = header.strip().lower()
    if value not in ("interactive", "batch"):
        raise InvalidRequestError("X-Prism-Priority must be 'interactive' or 'batch'", param="X-Prism-Priority")
    return value  # type: ignore[return-value]


def _priority(req: ChatCompletionRequest, header: str | None) -> Priority:
    """The body's ``priority``, else ``X-Prism-Priority``, else interactive."""
    return req.priority if req.priority is not None else header_priority(header)
