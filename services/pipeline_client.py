"""What the ingress does for one request to one served model, whatever the protocol (HTTP or gRPC).

One client per served model: the ingress picks it by the request's ``model`` after :mod:`common.auth` has
authenticated the request from its headers. :meth:`PipelineClient.begin` validates the OpenAI body and the pre-fetch
media limits (400s that cost nothing downstream), fixes the absolute deadline, and chains the model's stages through
Serve handles — media → encode → prefill → decode — passing each stage's *response* to the next, so pixels,
embeddings and KV go replica to replica through the object store (or NIXL) and never through the ingress. It waits
for the decode stream's :class:`StreamStart` (the prompt's token ids), so every stage's error surfaces before a
protocol commits to a status; a chain that lost a replica before that point is issued again (bounded, jittered —
:mod:`services.retry`) under a new attempt number. :meth:`PipelineClient.tokens` then yields
``(token_id, finish_reason)`` from the typed decode events under the deadline.

Admission at the ingress, in the order the costs appear (:mod:`common.sched`): the body's counts and parameters, then
the prompt's text tokens (the request's :class:`ResourceVector` as far as the ingress can know it — complete for a
text-only request, whose prompt and KV limits are checked here), then the tenant's quota (429
``tenant_quota_exceeded``). The quota's ticket is charged the media stage's pixels, patches and visual tokens when
they reach the ingress with the stream's start, and released when the request closes, however it closes.

**KV before prefill.** Each attempt reserves the request's decode KV before it issues prefill (media and encode run
meanwhile): :mod:`services.kv_reserver`. The reserving replica is named in the attempt's context, where the decode
router sends ``generate``; an attempt that fails before its stream claimed the reservation gives it back.

Each attempt carries one :class:`RequestContext` (id, attempt, tenant, deadline, priority, ``sent_at``, the vector)
to every stage, and the client keeps every stage response of the attempt: a failed attempt, a 504 or a client gone
cancels the whole chain (media, encode, prefill, decode), not only the decode stream.

**Decode migration.** When the decode replica of a started call is lost (the stream raises a replica-lost error),
:meth:`PipelineClient.tokens` issues the chain again as a new attempt — the prompt's prefill as before (embeddings
from the encoder cache or encoded again) — with the tokens the client already received as the decode call's
``replay``: the live replica rebuilds the sequence through them with ordinary decode steps and the stream goes on from
the next token, with no error, no repeat and no gap in what the client receives (:mod:`common.engine.decode`,
*Replay*). At most ``server.max_migrations`` per request, never past its deadline; counted in
``prism_migrations_total{outcome}`` and listed in the trace.

Every call carries a :class:`RequestTrace`: the ingress span closes when the chain is issued (the context's
``sent_at``), the stages' spans arrive with the stream's start event and first token (with where the encode and
prefill routers sent the calls, by the :class:`RouteKeys` made here), and every token is stamped as it arrives here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from common.cache.scope import cache_scope
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
from common.obs.trace import Span, Traced
from common.protocol.body import ascii_int
from common.protocol.handoff import (
    DecodeEvent,
    Priority,
    RequestContext,
    StreamAbort,
    StreamStart,
    StreamToken,
)
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from common.sched.affinity import RouteKeys, media_key, prefix_key
from common.sched.quota import TenantQuotas, Ticket
from common.sched.resources import ResourceVector, check_limits
from common.stages.prompt import render_chat
from services import route_log
from services.kv_reserver import KVReserver
from services.lifecycle import CANCELLED, REPLICA_LOST, replica_lost
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
    chain: list[Any]
    """Every stage response of the attempt (media, encode, prefill, the decode stream): cancelled together."""
    release: Any
    """Gives the tenant's quota back (idempotent)."""
    reissue: Callable[[tuple[int, ...]], Awaitable[tuple[list[Any], RequestContext, StreamStart]]] | None = None
    """Issues the chain again as a new attempt whose decode call replays the given tokens (decode migration)."""
    kv_blocks: int = 0
    migrations: int = 0

    @property
    def rid(self) -> str:
        return self.ctx.request_id

    def close(self) -> None:
        """Cancel whatever of the chain still runs and give the quota back; safe to call more than once."""
        try:
            _cancel(self.chain)
        finally:
            self.release()


@dataclass(frozen=True)
class _Migration:
    started: float
    after_tokens: int
    cause: str


def _cancel(chain: list[Any]) -> None:
    for response in reversed(chain):  # decode first: it frees KV at once
        try:
            response.cancel()
        except Exception:  # Serve's cancel() re-raises the error of a call that already failed: nothing to cancel
            pass


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
        """``metrics``: the ingress's :class:`services.metrics.Metrics` (admission decisions are counted there)."""
        self.cfg = cfg
        self.frontend = frontend
        self.quotas = quotas or TenantQuotas(cfg.admission, retry_after_s=cfg.server.retry_after_s)
        self.metrics = metrics
        self.media: DeploymentHandle = media
        self.encode: DeploymentHandle = encode
        self.prefill: DeploymentHandle = prefill
        self.decode: DeploymentHandle = decode
        self.kv = KVReserver(cfg, frontend, decode)

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
                _cancel(chain)
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
            first = await self._next(stream, ctx.deadline)
            if not isinstance(first, StreamStart):
                raise HandoffError(f"the decode stream began with {type(first).__name__}, not its start")
            return chain, ctx, first
        except BaseException:
            _cancel(chain)
            if reserved:  # a reservation no generate may claim now (one already claimed is the stream's to free)
                self.kv.give_back(ctx)
            raise

    async def tokens(self, call: Call) -> AsyncIterator[tuple[int, str | None]]:
        """``(token_id, finish_reason)`` until the sequence finishes; raises 504 / 500 on timeout / failure. A lost
        decode replica is replaced by a migration (up to ``server.max_migrations``), unseen by the caller."""
        sent: list[int] = []
        moving: _Migration | None = None  # a migration whose stream has not produced a new token yet
        while True:
            try:
                event = await self._next(call.stream, call.ctx.deadline)
                if isinstance(event, StreamAbort):
                    if event.reason == "timeout":
                        raise DeadlineExceeded("deadline exceeded during decode")
                    raise PrismError("decode failed; see the decode replica's log")
                if not isinstance(event, StreamToken):
                    raise HandoffError(f"the decode stream sent {type(event).__name__} where a token was due")
            except CANCELLED:
                raise
            except BaseException as exc:
                if moving is not None:  # the rebuilt stream failed before its first new token
                    self._migration_done(call, moving, "failed")
                    moving = None
                if not isinstance(exc, REPLICA_LOST):
                    raise
                moving = await self._migrate(call, tuple(sent), exc)
                continue
            if moving is not None:
                self._migration_done(call, moving, "resumed")
                moving = None
            else:  # (a migrated stream's spans would repeat stages the trace has; its entry says what it cost)
                call.trace.absorb(event.spans)
            call.trace.token()
            if event.finish_reason is not None:
                call.kv_blocks = event.kv_blocks
            sent.append(event.token_id)
            yield event.token_id, event.finish_reason
            if event.finish_reason is not None:
                return

    async def _migrate(self, call: Call, sent: tuple[int, ...], lost: BaseException) -> _Migration:
        """Continue ``call`` on a live decode replica after its own was lost: the chain again, replaying ``sent``;
        returns once the new stream started. Re-raises ``lost`` when migration is off or spent (504 when the
        deadline leaves no time)."""
        if time.time() >= call.ctx.deadline:
            self._count_migration("refused")
            raise DeadlineExceeded("deadline exceeded when the decode replica was lost") from lost
        if call.reissue is None or call.migrations >= self.cfg.server.max_migrations:
            self._count_migration("refused")
            raise lost
        call.migrations += 1
        _cancel(call.chain)  # whatever of the lost attempt still runs (a replica merely unreachable frees its KV)
        moving = _Migration(time.time(), len(sent), type(lost).__name__)
        try:
            chain, ctx, first = await call.reissue(sent)
            if list(first.prompt_token_ids) != call.prompt_ids:
                _cancel(chain)
                raise HandoffError("a migrated stream's prompt differs from the original attempt's")
        except CANCELLED:
            raise
        except BaseException:
            self._migration_done(call, moving, "failed")
            raise
        call.chain, call.stream, call.ctx = chain, chain[-1], ctx
        if ctx.decode_replica is not None:
            call.trace.route("decode", ctx.reservation, ctx.decode_replica)
        return moving

    def _migration_done(self, call: Call, moving: _Migration, outcome: str) -> None:
        """Record a migration once its outcome is known: ``resumed`` at the rebuilt stream's first new token (so its
        time covers the chain, the replay and the lease wait), ``failed`` if it ended before that."""
        call.trace.migrated(moving.after_tokens, time.time() - moving.started, moving.cause, outcome)
        self._count_migration(outcome)

    def _count_migration(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("prism_migrations_total", outcome=outcome)

    async def collect(self, call: Call) -> tuple[list[int], str]:
        """Every token of a non-streaming call and its finish reason; the stream is closed either way."""
        out: list[int] = []
        finish: str | None = None
        try:
            async for token, reason in self.tokens(call):
                out.append(token)
                finish = reason
        finally:
            _cancel(call.chain)
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
        except RayServeException as exc:  # an upstream replica of the chain died: a replica loss like any other
            lost = replica_lost(exc)
            if lost is None:
                raise
            raise lost from None


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
