"""``observability:`` — request traces and the request log."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Strict


class ObservabilityConfig(Strict):
    """Request traces and the request log (metrics need no settings: they go to Ray's metrics port)."""

    media_hash_key: str = ""
    """Secret key of the keyed hash that names media in traces and logs (HMAC of the bytes' digest). Empty: the app
    builder draws a random one per deployment of the application (hashes then correlate only within it)."""
    request_log: bool = True
    """Write one JSON line per finished request (ids, shapes, cache outcomes, timings; never content)."""
    request_log_path: str | None = None
    """Append the request log to this file instead of the ingress replica's stderr (which Ray keeps in its worker
    logs)."""
    allow_client_traces: bool = True
    """Honour ``X-Prism-Trace: 1`` (return the trace in the response). Off: the header is ignored."""
    trace_cache_hits: bool = False
    """Client traces carry cache outcomes (processor/encoder hits and misses, prefix-cached tokens, prefill chunks).
    Off by default: a hit tells a caller that someone sharing its cache scope (its tenant, or every tenant with
    ``engine.shared_cache_scope``) sent the same image or prompt prefix. The request log and the metrics keep them
    either way; the local configs and the load generator turn it on."""
    otlp_endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    """OTLP/HTTP traces endpoint (``http://<collector>:4318/v1/traces``): each request's spans — the ingress's own
    work and every stage's queue, work and transfer — are exported there (OpenTelemetry), continuing the client's W3C
    ``traceparent``; the response then carries a ``traceresponse`` header (gRPC: trailing metadata). ``None``: no
    export, no cost."""
    otlp_service_name: str = "prism"
    """``service.name`` of the exported spans."""
