"""A request planned and admitted at the ingress, before any stage is called — pure, testable without Serve.

Lifecycle of one request here (each step a 4xx/429 that costs milliseconds, in the order its cost appears):

```
headers ──RequestHeaders──► (the key authenticates, the tenant's quota enters it: services.ingress.server)
body ──plan() [worker thread]──► Plan: parsed + validated, priority, deadline, sampling (with its output constraint, if
        any — a response_format, or what tool_choice allows with the model's call tags: compiled next, on the
        grammar thread, by the pipeline), the function definitions, media references and their
        pre-fetch limits, the prompt rendered with one placeholder per item and tokenised, cache-affinity route keys,
        the ResourceVector as far as the ingress can know it, the KV blocks to reserve on a decode replica
     ──admit() [event loop]──► AdmittedRequest: the per-request limits on the vector, then the tenant's quota (ticket)
```

:func:`plan` touches no shared state (it runs in a worker thread: tokenising never stalls the event loop);
:func:`admit` charges the tenant's quota ticket, so it runs on the loop that gives it back. Every decision of
:func:`admit` is counted by the ingress's :class:`~common.admission.record.AdmissionRecorder`. The admitted request is
frozen: the chain (:mod:`services.ingress.chain`) issues attempts from it and nothing changes it on the way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.admission.limits import check_limits
from common.admission.quota import TenantQuotas, Ticket
from common.admission.record import AdmissionRecorder
from common.cache.scope import cache_scope
from common.config import PrismConfig
from common.errors import InvalidRequestError, PrismError
from common.media.loader import check_request
from common.model.loader import ModelFrontend
from common.protocol.body import ascii_int
from common.protocol.handoff import MediaRef, Priority, RouteKeys
from common.protocol.openai import ChatCompletionRequest, parse_chat_request
from common.protocol.sampling import SamplingParams
from common.protocol.vector import ResourceVector
from common.sched.affinity import media_key, prefix_key
from common.stages.prompt import render_chat
from common.tools.grammar import markers_for, renders_tools, tool_guide


@dataclass(frozen=True)
class RequestHeaders:
    """What the ingress reads before the body, parsed once (HTTP headers, or gRPC metadata and message fields)."""

    api_key: str | None = None
    priority: Priority | None = None
    """``X-Prism-Priority`` (``None``: absent, or not a class — see ``priority_invalid``)."""
    priority_invalid: bool = False
    """The header named no class: a 400 once the body shows no ``priority`` of its own."""
    deadline_ms: str | int | None = None
    """``X-Prism-Deadline-Ms`` as sent (gRPC: the message's ``deadline_ms``), checked by :func:`deadline`."""
    trace: str | None = None
    """``X-Prism-Trace`` as sent."""
    traceparent: str | None = None
    """W3C ``traceparent`` as sent (the exported trace continues it: :mod:`common.obs.otel`)."""

    @classmethod
    def read(
        cls, get: Callable[[str], str | None], api_key: str | None, deadline_ms: str | int | None
    ) -> RequestHeaders:
        """From a header lookup ``get`` (lower-case names), the caller's ``api_key`` and deadline budget."""
        raw = get("x-prism-priority")
        value = None if raw in (None, "") else raw.strip().lower()
        valid = value in (None, "interactive", "batch")
        priority: Priority | None = value if valid else None  # type: ignore[assignment]
        return cls(api_key, priority, not valid, deadline_ms, get("x-prism-trace"), get("traceparent"))

    @property
    def header_class(self) -> Priority:
        """The class the headers name (interactive when they name none): what a refusal before the body counts."""
        return self.priority or "interactive"

    def resolve_priority(self, body_priority: Priority | None) -> Priority:
        """The body's ``priority``, else the header's, else interactive; 400 when it falls to an invalid header."""
        if body_priority is not None:
            return body_priority
        if self.priority_invalid:
            raise InvalidRequestError("X-Prism-Priority must be 'interactive' or 'batch'", param="X-Prism-Priority")
        return self.header_class


@dataclass(frozen=True)
class Plan:
    """A request as the ingress understood it, before admission (see the module docstring)."""

    tenant: str
    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    """The chat messages with media reduced to markers: what prefill renders the prompt from."""
    tools: list[dict[str, Any]] | None
    """The function definitions the chat template renders with them (``None``: the request offers no tools)."""
    sampling: SamplingParams
    refs: tuple[MediaRef, ...]
    """The media references, in order (what the media stage fetches)."""
    priority: Priority
    deadline: float
    """Absolute wall-clock seconds."""
    vector: ResourceVector
    route: RouteKeys | None
    """Cache-affinity keys (``None`` with ``routing.affinity`` off)."""
    kv_blocks: int
    """KV blocks to reserve on a decode replica before prefill (see :func:`kv_estimate`)."""


@dataclass(frozen=True)
class AdmittedRequest(Plan):
    """A planned request the per-request limits and the tenant's quota let in; its ``ticket`` goes back when the
    request's lifecycle closes."""

    ticket: Ticket


def deadline(cfg: PrismConfig, budget_ms: str | int | None, now: float) -> float:
    """The absolute deadline of a request whose budget header says ``budget_ms`` (the default budget when absent)."""
    server = cfg.server
    budget = server.default_deadline_ms
    if budget_ms not in (None, "", 0):
        parsed = ascii_int(str(budget_ms), max_digits=12)
        if parsed is None or parsed < 1:
            raise InvalidRequestError("X-Prism-Deadline-Ms must be a positive integer", param="X-Prism-Deadline-Ms")
        budget = parsed
        if budget > server.max_deadline_ms:
            raise InvalidRequestError(
                f"X-Prism-Deadline-Ms is {budget}; the limit is {server.max_deadline_ms}", param="X-Prism-Deadline-Ms"
            )
    return now + budget / 1000.0


def plan(
    cfg: PrismConfig,
    frontend: ModelFrontend,
    tenant: str,
    body: Any,
    headers: RequestHeaders,
    now: float | None = None,
) -> Plan:
    """Validate the decoded ``body`` of an authenticated ``tenant`` for the model ``frontend`` serves and price it
    (see the module docstring); raises the 4xx of the first check it fails. No shared state: safe in a thread."""
    req = parse_chat_request(body, cfg.server)  # (the ingress picked this model by the body's `model`)
    priority = headers.resolve_priority(req.priority)
    until = deadline(cfg, headers.deadline_ms, time.time() if now is None else now)
    sampling = req.sampling(default_max_tokens(cfg, req.n or 1)).resolved()
    tools = None
    if req.tool_request is not None:  # (what tool_choice allows, with the model's call tags, replaces the guide)
        if not renders_tools(frontend.tokenizer):
            message = f"model {frontend.served_name}'s chat template does not render tools"
            raise InvalidRequestError(message, code="invalid_tools", param="tools")
        markers = markers_for(frontend.tokenizer)
        guide = tool_guide(req.tool_request, markers, sampling.guide, cfg.server.max_tool_calls)
        sampling = sampling.model_copy(update={"guide": guide})
        tools = req.tool_request.template_tools()
    if sampling.max_tokens > cfg.engine.max_output_tokens:
        raise InvalidRequestError(
            f"max_tokens is {sampling.max_tokens}; the limit is {cfg.engine.max_output_tokens}", param="max_tokens"
        )
    refs = tuple(req.media_refs())
    check_request(refs, cfg.media)
    messages = req.template_messages()
    ids = frontend.tokenizer(render_chat(frontend, messages, tools))["input_ids"]
    data_bytes = sum(len(r.url) * 3 // 4 for r in refs if r.url[:5].lower() == "data:")
    block_size = cfg.engine.kv_block_size
    vector = ResourceVector.at_ingress(
        len(ids), len(refs), sampling.max_tokens, block_size, media_bytes=data_bytes, choices=sampling.n
    )
    return Plan(
        tenant=tenant,
        request=req,
        messages=messages,
        tools=tools,
        sampling=sampling,
        refs=refs,
        priority=priority,
        deadline=until,
        vector=vector,
        route=route_keys(cfg, frontend, tenant, ids, refs),
        kv_blocks=kv_estimate(cfg, frontend, refs, vector),
    )


def default_max_tokens(cfg: PrismConfig, n: int) -> int:
    """``max_tokens`` of a request that sets none: ``engine.max_output_tokens``, or — ``n`` choices sharing the
    request's output limit — its ``n``-th part, so a request that leaves it unset is never over that limit."""
    return min(cfg.engine.max_output_tokens, max(1, cfg.admission.max_request_output_tokens // n))


def route_keys(
    cfg: PrismConfig, frontend: ModelFrontend, tenant: str, ids: list[int], refs: tuple[MediaRef, ...]
) -> RouteKeys | None:
    """The request's cache-affinity keys (:mod:`common.sched.affinity`) from its rendered prompt's token ``ids``;
    ``None`` with ``routing.affinity`` off."""
    routing = cfg.routing
    if not routing.affinity:
        return None
    scope = cache_scope(tenant, cfg.engine.shared_cache_scope)
    media = [media_key(scope, ref.url) for ref in refs]
    placeholders = frozenset(frontend.placeholder_id(m) for m in frontend.adapter.modalities)
    prefix = prefix_key(scope, ids, placeholders, media, routing.prefix_key_tokens)
    return RouteKeys(media=media[0] if media else None, prefix=prefix)


def kv_estimate(cfg: PrismConfig, frontend: ModelFrontend, refs: tuple[MediaRef, ...], vector: ResourceVector) -> int:
    """KV blocks to reserve for a request with media ``refs`` whose ingress vector is ``vector``: prompt +
    ``max_tokens`` (each of its ``n`` choices', the prompt's full blocks once) — exact for a text-only request; with
    media, each image counted as a small image's visual tokens (exact for a fixed-resolution family like LLaVA) and
    each video as one token. Never over the per-request lease
    (over it is the media stage's to refuse, from the real count)."""
    if not refs:
        return vector.kv_blocks
    small = frontend.small_image_tokens
    visual = sum(small if ref.kind == "image" else 1 for ref in refs)
    eng = cfg.engine
    return min(vector.kv_blocks_of(vector.text_tokens + visual, eng.kv_block_size), eng.max_lease_blocks)


def admit(
    plan: Plan, ticket: Ticket, cfg: PrismConfig, quotas: TenantQuotas, recorder: AdmissionRecorder
) -> AdmittedRequest:
    """The per-request limits (complete for a text-only request; for one with media the vector is a lower bound, so
    over a limit here is over it for certain), then the tenant's quota on the ``ticket`` the request entered with
    (its in-flight place, taken before the body was read); each decision counted."""
    reason = "limit"
    try:
        eng = cfg.engine
        check_limits(plan.vector, cfg.admission, eng.max_prompt_tokens, eng.max_lease_blocks)
        reason = "quota"
        quotas.admit(ticket, plan.vector)
    except PrismError:
        recorder.refused(plan.tenant, plan.priority, reason)
        raise
    recorder.admitted(plan.tenant, plan.priority)
    fields = {name: getattr(plan, name) for name in Plan.__dataclass_fields__}
    return AdmittedRequest(**fields, ticket=ticket)
