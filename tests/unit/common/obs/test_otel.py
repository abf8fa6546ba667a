"""OpenTelemetry export of a request trace to a real OTLP/HTTP receiver: one root span continuing the client's
``traceparent`` (or a new trace), one child per stage span with its own times and content-free attributes."""

from __future__ import annotations

from common.obs.otel import OtlpTraces, RequestSpan
from common.obs.request_trace import RequestTrace
from common.obs.trace import Span
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

PARENT_TRACE, PARENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _export(traceparent: str, **options) -> tuple[RequestSpan, list[ReceivedSpan]]:
    """A request's trace exported to a real receiver: its root span (opened at arrival, as the ingress does) and every
    span the receiver got for the trace it names."""
    with OtlpReceiver() as receiver:
        otel = OtlpTraces(receiver.endpoint, **options)
        clock = [100.0]
        trace = RequestTrace("chatcmpl-1", "http", clock=lambda: clock[0])
        root = otel.begin(trace, traceparent)
        trace.tenant = "alpha"
        trace.absorb(
            (
                Span("ingress", 100.0, 0.004, {"prompt_tokens": 12}),
                Span("media.process", 100.004, 0.02, {"visual_tokens": 64, "processor_cache_hits": 1}),
                Span("prefill", 100.024, 0.05, {"prompt_tokens": 76, "chunks": 1}),
            )
        )
        clock[0] = 100.1
        trace.token()
        clock[0] = 100.2
        trace.token()
        trace.finish(200, "ok")
        otel.end(trace, root)
        otel.provider.force_flush()
        spans = receiver.trace(root.traceresponse.split("-")[1], until=lambda s: len(s) == 6)
        otel.shutdown()
    return root, spans


def test_a_requests_spans_reach_the_collector_under_the_clients_trace():
    root, spans = _export(f"00-{PARENT_TRACE}-{PARENT_SPAN}-01", service_name="prism-test")
    assert root.traceresponse.startswith(f"00-{PARENT_TRACE}-") and root.traceresponse.endswith("-01")
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"prism.request", "ingress", "media.process", "prefill", "first_token", "decode"}
    request = by_name["prism.request"]
    assert request.parent_span_id == PARENT_SPAN and request.span_id == root.traceresponse.split("-")[2]
    assert request.service == "prism-test" and request.attributes["prism.tenant"] == "alpha"
    assert request.attributes["prism.status"] == 200 and request.attributes["prism.output_tokens"] == 2
    for name in ("ingress", "media.process", "prefill", "first_token", "decode"):
        assert by_name[name].parent_span_id == request.span_id
    media = by_name["media.process"]
    assert (media.start_ns, media.end_ns) == (100_004_000_000, 100_024_000_000)
    assert media.attributes == {"visual_tokens": 64}, "cache outcomes stay out unless trace_cache_hits"
    assert by_name["prefill"].attributes == {"prompt_tokens": 76}


def test_without_a_valid_traceparent_the_request_starts_a_trace():
    root, spans = _export("00-not-a-valid-parent-01", cache_outcomes=True)
    trace_id = root.traceresponse.split("-")[1]
    assert len(trace_id) == 32 and trace_id != PARENT_TRACE and len(spans) == 6
    (request,) = [s for s in spans if s.name == "prism.request"]
    assert request.parent_span_id == "" and request.service == "prism"
    media = next(s for s in spans if s.name == "media.process")
    assert media.attributes["processor_cache_hits"] == 1  # (with trace_cache_hits)
