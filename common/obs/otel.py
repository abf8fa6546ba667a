"""OpenTelemetry export of request traces over OTLP/HTTP — off unless ``observability.otlp_endpoint`` is set.

Lifecycle: the ingress replica makes one :class:`OtlpTraces` at start: its own ``TracerProvider`` (never the global
one, which Serve's own tracing may set), a batch span processor and the OTLP/HTTP exporter. When a request arrives,
:meth:`OtlpTraces.begin` opens its root span ``prism.request`` — a child of the client's W3C ``traceparent`` when it
sent a valid one, else the root of a new trace — and its :attr:`RequestSpan.traceresponse` is what the response
returns (HTTP header / gRPC trailing metadata ``traceresponse``), so a caller can find the trace. When the request
closes, :meth:`OtlpTraces.end` adds one child span per span of its :class:`RequestTrace` — the ingress's own work,
each stage's queue, work and transfer, decode — with their own start and end times and attributes (shapes, counts,
timings: never content; cache outcomes only with ``observability.trace_cache_hits``), then ends the root with the
request's status. The processor exports from its own thread in batches: a collector that is down drops spans, it
never slows or fails a request. With no endpoint nothing here is imported or built: no cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.obs.request_trace import CACHE_OUTCOME_ATTRS, RequestTrace

TRACER = "prism"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class RequestSpan:
    """A request's root span, open from its arrival to its close."""

    span: Any
    traceresponse: str
    """``00-<trace id>-<root span id>-<flags>``: W3C Trace Context's response header value."""


class OtlpTraces:
    def __init__(self, endpoint: str, service_name: str = "prism", cache_outcomes: bool = False) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=5)
        # (a request is ~20 spans: the queue holds a burst of ~800 requests before it drops any)
        self.processor = BatchSpanProcessor(
            exporter, schedule_delay_millis=500, max_queue_size=16384, max_export_batch_size=2048
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(TRACER)
        self.propagator = TraceContextTextMapPropagator()
        self.cache_outcomes = cache_outcomes

    def begin(self, trace: RequestTrace, traceparent: str | None) -> RequestSpan:
        """Open ``trace``'s root span, under the client's ``traceparent`` if it is a valid one."""
        from opentelemetry import trace as otel

        parent = self.propagator.extract({"traceparent": traceparent} if traceparent else {})
        span = self.tracer.start_span("prism.request", context=parent, start_time=_ns(trace.start), kind=_server())
        ctx = span.get_span_context()
        flags = f"{int(ctx.trace_flags):02x}"
        response = f"00-{otel.format_trace_id(ctx.trace_id)}-{otel.format_span_id(ctx.span_id)}-{flags}"
        return RequestSpan(span, response)

    def end(self, trace: RequestTrace, root: RequestSpan) -> None:
        """The stage spans of a closed ``trace`` under its root, then the root, ended at the request's end."""
        from opentelemetry import trace as otel
        from opentelemetry.trace import Status, StatusCode

        parent = otel.set_span_in_context(root.span)
        for s in trace.timeline.spans:
            attrs = {k: v for k, v in s.attrs.items() if self.cache_outcomes or k not in CACHE_OUTCOME_ATTRS}
            child = self.tracer.start_span(s.name, context=parent, start_time=_ns(s.start), attributes=attrs)
            child.end(end_time=_ns(s.end))
        root.span.set_attributes(_root_attributes(trace))
        if trace.status >= 500:
            root.span.set_status(Status(StatusCode.ERROR, trace.code))
        root.span.end(end_time=_ns(trace.end if trace.end is not None else trace.clock()))

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter's thread."""
        self.provider.shutdown()


def _server() -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER


def _root_attributes(trace: RequestTrace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prism.request_id": trace.request_id,
        "prism.protocol": trace.protocol,
        "prism.tenant": trace.tenant,
        "prism.status": trace.status,
        "prism.code": trace.code,
        "prism.prompt_tokens": trace.prompt_tokens,
        "prism.output_tokens": len(trace.token_times),
    }
    if trace.ttft_s is not None:
        out["prism.ttft_ms"] = round(trace.ttft_s * 1000, 3)
    return out
