"""What the ingress does for one request to one served model, whatever the protocol (HTTP or gRPC): plan → admit →
issue → read.

One client per served model: the ingress picks it by the request's ``model`` after the key authenticated the request
from its headers. :meth:`PipelineClient.begin` plans the request in a worker thread (:func:`services.ingress.plan.plan`:
parse, validate, price), admits it on the event loop (:func:`services.ingress.plan.admit`: per-request limits, the
tenant's quota ticket) and issues its chain (:class:`services.ingress.chain.Chain`), returning once the decode stream
started. The :class:`~services.ingress.call_stream.Call` it returns is read by :meth:`PipelineClient.tokens` /
:meth:`PipelineClient.collect` (:class:`~services.ingress.call_stream.CallStream`: the typed decode events under the
deadline, and decode migration when the decode replica is lost mid-stream, or leaves its deployment:
:mod:`services.ingress.leaving`).

The quota ticket is charged what the media stage measured (pixels, patches, visual tokens) when it reaches the ingress
with the stream's start; the request's lifecycle releases it when the request closes, however it closes. Every call
carries a :class:`RequestTrace`: the ingress span closes when the chain is issued (the first attempt's ``sent_at``), the
stages' spans arrive with the stream's start and first token (with where the encode, prefill and decode routers sent the
calls), and every token is stamped as it arrives here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from common.admission.quota import TenantQuotas, Ticket
from common.admission.record import AdmissionRecorder
from common.config import PrismConfig
from common.model.loader import ModelFrontend
from common.obs.request_trace import RequestTrace
from common.obs.trace import Span
from common.protocol.vector import ResourceVector
from services.ingress.body import INLINE_BYTES, off_loop
from services.ingress.call_stream import Call, CallStream, carried
from services.ingress.chain import Chain, Started
from services.ingress.plan import RequestHeaders, admit, plan
from services.ingress.responses import cancel_chain
from services.routers import replica_sets, route_log
from services.stages.threads import compile_guide


class PipelineClient:
    def __init__(
        self,
        cfg: PrismConfig,
        frontend: ModelFrontend,
        chain: Chain,
        quotas: TenantQuotas | None = None,
        recorder: AdmissionRecorder | None = None,
        metrics: Any = None,
    ) -> None:
        """``recorder``: the ingress's admission recorder; ``metrics``: its metrics (migrations are counted there)."""
        self.cfg, self.frontend, self.chain = cfg, frontend, chain
        self.quotas = quotas or TenantQuotas(cfg.admission, retry_after_s=cfg.server.retry_after_s)
        self.recorder = recorder or AdmissionRecorder(metrics, "ingress")
        self.metrics = metrics
        server, decode = cfg.server, chain.of["decode"]
        named = hasattr(decode, "deployment_name")  # (not the in-process harness's handles)
        deployment = replica_sets.key(decode.app_name, decode.deployment_name) if named else None
        self.streams = CallStream(
            server.max_migrations, self._count_migration, server.drain_grace_s, deployment, self._count_left
        )

    async def begin(
        self, ticket: Ticket, body: Any, headers: RequestHeaders, trace: RequestTrace, size: int = INLINE_BYTES
    ) -> Call:
        """Plan, admit and issue the decoded ``body`` (``size`` bytes of JSON) of a request that entered its tenant's
        quota with ``ticket`` (the request's lifecycle gives it back); returns once decode started. Every check before
        the chain is a 4xx/429 that costs milliseconds (see :mod:`services.ingress.plan`); a large body is planned in
        a worker thread, a small one on the loop (:func:`services.ingress.body.off_loop`)."""
        tenant = trace.tenant = ticket.tenant
        planned = await off_loop(size, plan, self.cfg, self.frontend, tenant, body, headers)
        # (a constraint that cannot be served is a 400 before any stage; compiled on the grammar thread, niced — the
        # request's own response_format first where tools wrap it, so that its refusal names it)
        if planned.request.guide is not planned.sampling.guide:
            await compile_guide(self.frontend, planned.request.guide)
        await compile_guide(self.frontend, planned.sampling.guide)
        admitted = admit(planned, ticket, self.cfg, self.quotas, self.recorder)
        started: Started | None = None
        try:
            request = admitted.request
            ignored = {"ignored_fields": request.ignored_fields} if request.ignored_fields else {}
            sampling = admitted.sampling
            trace.sent(
                media_items=len(admitted.refs), max_tokens=sampling.max_tokens, priority=admitted.priority, **ignored
            )
            issue = self.chain.issuer(admitted, trace)
            started = await issue(())
            _absorb(trace, started)
            self._charge_media(admitted.ticket, admitted.vector, started.first.spans)
        except BaseException:
            if started is not None:
                cancel_chain(started.responses)
            raise
        return Call(
            ctx=started.ctx,
            frontend=self.frontend,
            admitted=admitted,
            stream=started.stream,
            prompt_ids=list(started.first.prompt_token_ids),
            trace=trace,
            chain=started.responses,
            reissue=issue,
            decode_replica=started.first.replica,
            carried=carried(started.first),
        )

    def _count_migration(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("prism_migrations_total", outcome=outcome)

    def _count_left(self, deployment: str) -> None:
        if self.metrics is not None:
            self.metrics.inc("prism_replicas_left_total", from_deployment=deployment)

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

    def tokens(self, call: Call) -> AsyncIterator[tuple[int, int, str | None]]:
        """``(choice index, token_id, finish_reason)`` of a started call
        (:meth:`services.ingress.call_stream.CallStream.tokens`)."""
        return self.streams.tokens(call)

    async def collect(self, call: Call) -> list[tuple[list[int], str]]:
        """Every choice's tokens and finish reason (:meth:`CallStream.collect`)."""
        return await self.streams.collect(call)


def _absorb(trace: RequestTrace, started: Started) -> None:
    """What the stream's start tells the trace: the stages' spans, where the routers sent the calls, the prompt."""
    trace.absorb(started.first.spans)
    ctx = started.ctx
    for stage in ("encode", "prefill"):
        decision = route_log.take(stage, ctx.key)
        if decision is not None:
            trace.route(stage, **decision)
    if started.decode_route is not None:
        trace.route("decode", *started.decode_route)
    trace.prompt_tokens = len(started.first.prompt_token_ids)
