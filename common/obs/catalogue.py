"""Every metric Prism exports, declared once: name, kind, help text, tag keys and histogram buckets.

The services create Ray metric objects from these declarations (:mod:`services.platform.metrics`); the Grafana
dashboards are checked against them (every PromQL expression must name a declared metric and only its labels), and the
e2e test checks the metrics endpoint exposes each one after real traffic. Ray's Prometheus exporter prefixes every name
with ``ray_`` (``prism_kv_blocks_used`` is scraped as ``ray_prism_kv_blocks_used``) and Serve adds the ``application``,
``deployment`` and ``replica`` labels to metrics recorded inside a replica (:data:`SERVE_TAGS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

EXPORT_PREFIX = "ray_"
SERVE_TAGS = ("application", "deployment", "replica")
STAGES = ("ingress", "media", "encode", "prefill", "decode")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    description: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    in_replica: bool = True
    """Recorded inside Serve replicas (which add :data:`SERVE_TAGS`); ``False`` for the controller's autoscaler."""
    on_failure: bool = False
    """Recorded only when a replica fails under a request, or leaves (a Ray counter cannot be set to 0), so a steady
    run never exports it; the test that causes the event checks it instead."""

    @property
    def exported(self) -> str:
        return EXPORT_PREFIX + self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """Names that appear on the metrics endpoint for this metric."""
        if self.kind == "histogram":
            return tuple(self.exported + s for s in ("_bucket", "_sum", "_count"))
        return (self.exported,)

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(self.tags) | (frozenset(SERVE_TAGS) if self.in_replica else frozenset())


def _c(name: str, desc: str, *tags: str) -> MetricSpec:
    return MetricSpec(name, "counter", desc, tags)


def _g(name: str, desc: str, *tags: str) -> MetricSpec:
    return MetricSpec(name, "gauge", desc, tags)


def _h(name: str, desc: str, buckets: tuple[float, ...], *tags: str) -> MetricSpec:
    return MetricSpec(name, "histogram", desc, tags, buckets)


METRICS: tuple[MetricSpec, ...] = (
    # ---- requests (ingress) ----------------------------------------------------------------------------------
    _c(
        "prism_requests_total",
        "Finished requests by protocol, HTTP status and outcome code.",
        "protocol",
        "status",
        "code",
    ),
    _h("prism_ttft_seconds", "Time to first token, measured at the ingress.", LATENCY_BUCKETS, "protocol"),
    _h("prism_itl_seconds", "Inter-token latency, every gap between streamed tokens.", ITL_BUCKETS, "protocol"),
    _h("prism_e2e_seconds", "Request arrival to last token (or error).", LATENCY_BUCKETS, "protocol", "code"),
    _h("prism_prompt_tokens", "Prompt tokens per request (text and visual).", TOKEN_BUCKETS),
    _h("prism_visual_tokens", "Visual tokens per request.", TOKEN_BUCKETS),
    _h("prism_output_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
    # ---- stages ------------------------------------------------------------------------------------------------
    _g("prism_replicas", "1 per live replica: sum by stage is the stage's replica count.", "stage"),
    _g("prism_stage_in_flight", "Requests inside a replica of the stage.", "stage"),
    _g(
        "prism_stage_queue_depth",
        "The stage's autoscaling signal, in its own unit (see services.platform.autoscaling).",
        "stage",
    ),
    _h(
        "prism_stage_queue_seconds",
        "Hand-off, routing and engine queue wait before a stage starts work.",
        LATENCY_BUCKETS,
        "stage",
    ),
    _h("prism_stage_work_seconds", "Time a stage spends working on one request.", LATENCY_BUCKETS, "stage"),
    MetricSpec(
        "prism_autoscale_desired_replicas",
        "gauge",
        "Replicas the queue-depth policy asks for (recorded by the Serve controller).",
        ("application", "deployment", "stage"),
        in_replica=False,
    ),
    # ---- admission ---------------------------------------------------------------------------------------------
    _c(
        "prism_admission_total",
        "Admission decisions by stage (ingress: tenant quota and per-request limits; decode: KV reserved before "
        "prefill), tenant, traffic class, result (admitted / refused) and reason.",
        "stage",
        "tenant",
        "class",
        "result",
        "reason",
    ),
    _h(
        "prism_admission_wait_seconds",
        "Time a request waited for room in a stage's budget, by traffic class and tenant.",
        LATENCY_BUCKETS,
        "stage",
        "class",
        "tenant",
    ),
    _c(
        "prism_admission_units_total",
        "Units of a stage's budget granted (media pixels, encode patches, prefill tokens, decode KV blocks), by "
        "tenant: each tenant's share of the stage's service (fair sharing keeps the shares to the tenants' "
        "weights).",
        "stage",
        "tenant",
        "unit",
    ),
    _g("prism_tenant_in_flight", "Requests of a tenant in flight in an ingress replica.", "tenant"),
    _c(
        "prism_route_affinity_total",
        "Cache-affinity routing decisions of an ingress replica, by the stage called (encode: media key; prefill: "
        "prompt-prefix key) and outcome (owner / new / moved / spilled / none; see common.sched.affinity).",
        "stage",
        "outcome",
    ),
    MetricSpec(
        "prism_migrations_total",
        "counter",
        "Decode migrations of an ingress replica: a stream whose decode replica was lost continued on a live one "
        "(resumed, counted at its first new token), ended before a new token (failed: an error or the deadline during "
        "the rebuild), or was not tried (refused: server.max_migrations spent, or no time left before the deadline).",
        ("outcome",),
        on_failure=True,
    ),
    MetricSpec(
        "prism_replicas_left_total",
        "counter",
        "Decode replicas an ingress replica saw leave the routing set of their deployment (autoscaler scale-down, "
        "rolling update, node drain; a replica that died leaves it too), by that deployment, counted from its first "
        "stream on; the streams it then moved off them are migrations.",
        ("from_deployment",),
        on_failure=True,
    ),
    # ---- caches -------------------------------------------------------------------------------------------------
    _c(
        "prism_cache_lookups_total",
        "Cache lookups by layer and result (processor/encoder: media items; prefix: KV blocks).",
        "cache",
        "result",
    ),
    _g("prism_cache_bytes", "Bytes held by a cache layer in this replica.", "cache"),
    # ---- structured outputs ----------------------------------------------------------------------------------------
    _c(
        "prism_grammar_compiles_total",
        "Output constraints (response_format, regex, choice) compiled in this replica, by result: compiled, refused "
        "(400 invalid_response_format) or cached (a compiled grammar reused).",
        "result",
    ),
    _c("prism_grammar_compile_seconds_total", "Seconds this replica spent compiling output constraints."),
    _c(
        "prism_grammar_mask_seconds_total",
        "Seconds decode steps spent filling and applying the token masks of grammar-constrained sequences.",
    ),
    _c("prism_grammar_masked_steps_total", "Decode steps with at least one grammar-constrained sequence."),
    # ---- KV ------------------------------------------------------------------------------------------------------
    _g("prism_kv_blocks_used", "KV pool blocks held by running sequences (decode replica)."),
    _g("prism_kv_blocks_free", "KV pool blocks free (decode replica)."),
    # ---- transfers -------------------------------------------------------------------------------------------------
    _c(
        "prism_transfer_bytes_total",
        "Bytes handed from one stage to the next, by backend and payload.",
        "backend",
        "payload",
    ),
    _h(
        "prism_transfer_seconds",
        "Hand-off time (upstream done -> downstream start, NIXL read included).",
        LATENCY_BUCKETS,
        "backend",
        "payload",
    ),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
BY_EXPORTED: dict[str, MetricSpec] = {m.exported: m for m in METRICS}
