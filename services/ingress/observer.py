"""The ingress's side of observability: one :class:`RequestTrace` per request → metrics, a log line, a trace body.

``start`` opens a trace when a request arrives; ``finish`` is called exactly once per request whatever its end (ok,
typed error, client gone) and records the request metrics (outcome by status and code, TTFT, every inter-token gap,
E2E, prompt/visual/output tokens) and the request log line. The log line is the trace summary: ids, tenant, shapes,
cache outcomes and timings — never the prompt, URLs or pixels (media appear as keyed hashes).
"""

from __future__ import annotations

import logging
import sys
import uuid

from common.config import ObservabilityConfig
from common.obs.otel import OtlpTraces, RequestSpan
from common.obs.request_trace import RequestTrace
from services.platform.metrics import Metrics


def _request_logger(cfg: ObservabilityConfig) -> logging.Logger:
    log = logging.getLogger("prism.requests")
    log.setLevel(logging.INFO)
    log.propagate = False  # one line per request, not repeated by the root logger's handlers
    if not log.handlers:
        handler: logging.Handler
        if cfg.request_log_path:
            handler = logging.FileHandler(cfg.request_log_path, encoding="utf-8")
        else:
            handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    return log


class RequestObserver:
    def __init__(self, cfg: ObservabilityConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics("ingress")
        self.log = _request_logger(cfg) if cfg.request_log else None
        self.otel = None
        if cfg.otlp_endpoint:  # (built only when configured: off costs nothing)
            self.otel = OtlpTraces(cfg.otlp_endpoint, cfg.otlp_service_name, cfg.trace_cache_hits)

    def start(self, protocol: str) -> RequestTrace:
        return RequestTrace(f"chatcmpl-{uuid.uuid4().hex}", protocol)

    def export(self, trace: RequestTrace, traceparent: str | None) -> RequestSpan | None:
        """The request's OpenTelemetry root span, open until :meth:`finish` (``None``: no export configured)."""
        return None if self.otel is None else self.otel.begin(trace, traceparent)

    def wants_trace(self, header: str | None) -> bool:
        return self.cfg.allow_client_traces and (header or "").strip().lower() in ("1", "true", "yes")

    def finish(
        self, trace: RequestTrace, status: int, code: str, kv_blocks: int = 0, exported: RequestSpan | None = None
    ) -> None:
        if trace.end is not None:
            return
        trace.finish(status, code, **({"kv_blocks": kv_blocks} if kv_blocks else {}))
        if exported is not None and self.otel is not None:
            self.otel.end(trace, exported)
        m, proto = self.metrics, trace.protocol
        m.inc("prism_requests_total", protocol=proto, status=str(status), code=code)
        m.observe("prism_e2e_seconds", trace.e2e_s, protocol=proto, code=code)
        ingress = next((s for s in trace.timeline.spans if s.name == "ingress"), None)
        if ingress is not None:  # the ingress's own work: parse, authenticate, check limits, issue the chain
            m.observe("prism_stage_work_seconds", ingress.duration_s)
        if trace.ttft_s is not None:
            m.observe("prism_ttft_seconds", trace.ttft_s, protocol=proto)
            for gap in trace.itl():
                m.observe("prism_itl_seconds", gap, protocol=proto)
            m.observe("prism_prompt_tokens", trace.prompt_tokens)
            m.observe("prism_visual_tokens", trace.attr_sum("visual_tokens", "media.process"))
            m.observe("prism_output_tokens", len(trace.token_times))
        if self.log is not None:
            self.log.info(trace.log_line())
