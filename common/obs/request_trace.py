"""The ingress's record of one request: its spans, token arrival times and outcome → one summary.

Lifecycle: created when the request arrives (``start``); :meth:`sent` closes the ``ingress`` span when the stage
chain is issued; :meth:`absorb` appends the spans that came back with the decode stream (media → encode → prefill →
decode hand-off); :meth:`token` stamps every token as the ingress receives it — the first one closes the
``first_token`` span (decode replica → ingress), so the spans before it add up to the time to first token;
:meth:`route` records where the cache-affinity routers sent the encode and prefill calls;
:meth:`finish` closes the ``decode`` span and fixes the outcome. :meth:`summary` is what ``X-Prism-Trace: 1`` returns
as ``prism_trace`` and what the request log writes as one JSON line: ids, shapes, cache outcomes, timings — never
content (spans carry only counts, shapes and keyed media hashes; the prompt and URLs never enter this object).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from common.obs.trace import Span, Timeline

CACHE_OUTCOME_ATTRS = frozenset(
    {
        "processor_cache_hits",
        "processor_cache_misses",
        "encoder_cache_hits",
        "encoder_cache_misses",
        "prefix_cached_tokens",
        "prefix_cached_visual_tokens",
        "chunks",  # prefill chunks count only the tokens computed: fewer on a prefix hit
    }
)
"""Span attributes that tell a cache hit from a miss; left out of a summary without cache outcomes."""


class RequestTrace:
    def __init__(self, request_id: str, protocol: str, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.request_id = request_id
        self.protocol = protocol
        self.start = clock()
        self.timeline = Timeline(self.start, clock=clock)
        self.tenant = ""
        self.token_times: list[float] = []
        """When each token arrived, every choice's (``n`` > 1 interleaves them)."""
        self._gaps: list[float] = []
        self._last_of: dict[int, float] = {}
        self.prompt_tokens = 0
        self.end: float | None = None
        self.status = 0
        self.code = ""
        self.routes: dict[str, dict[str, str]] = {}
        """Stage → its cache-affinity routing decision (``outcome``, ``replica``), where the stage was routed by key."""
        self.migrations: list[dict[str, Any]] = []
        """Decode migrations (:meth:`migrated`)."""

    # ---- recording ------------------------------------------------------------------------------------------
    def sent(self, **attrs: Any) -> None:
        self.timeline.mark("ingress", **attrs)

    def absorb(self, spans: Iterable[Span]) -> None:
        """Spans measured by the stages; they continue from where the ingress span ended."""
        for span in spans:
            self.timeline.spans.append(span)
            self.timeline.last = max(self.timeline.last, span.end)

    def route(self, stage: str, outcome: str, replica: str) -> None:
        self.routes[stage] = {"outcome": outcome, "replica": replica}

    def migrated(self, after_tokens: int, took_s: float, cause: str, outcome: str) -> None:
        """One decode migration: tokens the client had, the time from the loss to the first new token (or to the
        failure), the exception that told of the loss, ``resumed`` / ``failed``."""
        self.migrations.append({"after_tokens": after_tokens, "ms": _ms(took_s), "cause": cause, "outcome": outcome})

    def token(self, choice: int = 0) -> float | None:
        """Stamp one received token of ``choice``; returns the gap since that choice's previous one (``None`` for its
        first): inter-token latency is each choice's own, not the gaps between choices decoded in the same step."""
        now = self.clock()
        if not self.token_times:
            self.timeline.mark("first_token")
        last = self._last_of.get(choice)
        gap = None if last is None else now - last
        if gap is not None:
            self._gaps.append(gap)
        self._last_of[choice] = now
        self.token_times.append(now)
        return gap

    def finish(self, status: int, code: str, **decode_attrs: Any) -> None:
        if self.end is not None:
            return
        self.end = self.clock()
        self.status, self.code = status, code
        if self.token_times:
            itl = self.itl()
            decode_attrs |= {"output_tokens": len(self.token_times)}
            if itl:
                decode_attrs |= {"itl_mean_ms": _ms(sum(itl) / len(itl)), "itl_max_ms": _ms(max(itl))}
            self.timeline.span("decode", self.token_times[-1] - self.timeline.last, **decode_attrs)

    # ---- reading ----------------------------------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e_s(self) -> float:
        return (self.end or self.clock()) - self.start

    def itl(self) -> list[float]:
        """The inter-token gaps, each choice's in its own sequence."""
        return list(self._gaps)

    def attr_sum(self, key: str, span: str | None = None) -> int:
        """Sum of an integer attribute over the spans (only those named ``span``, if given)."""
        total = 0
        for s in self.timeline.spans:
            value = s.attrs.get(key, 0)
            if (span is None or s.name == span) and isinstance(value, int) and not isinstance(value, bool):
                total += value
        return total

    def summary(self, cache_outcomes: bool = True) -> dict[str, Any]:
        """The summary; ``cache_outcomes=False`` leaves out the ``cache`` section and every span attribute in
        :data:`CACHE_OUTCOME_ATTRS` (what a client sees unless ``observability.trace_cache_hits``)."""
        ttft = self.ttft_s
        spans = self.timeline.spans
        itl = sorted(self.itl())
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "protocol": self.protocol,
            "status": self.status,
            "code": self.code,
            "ttft_ms": _ms(ttft) if ttft is not None else None,
            "e2e_ms": _ms(self.e2e_s),
            "prompt_tokens": self.prompt_tokens,
            "visual_tokens": self.attr_sum("visual_tokens", "media.process"),
            "output_tokens": len(self.token_times),
            "itl_ms": _quantiles(itl),
            "cache": {
                "processor": {k: self.attr_sum(f"processor_cache_{k}") for k in ("hits", "misses")},
                "encoder": {k: self.attr_sum(f"encoder_cache_{k}") for k in ("hits", "misses")},
                "prefix": {k: self.attr_sum(f"prefix_{k}") for k in ("cached_tokens", "cached_visual_tokens")},
                "routing": self.routes,  # (where a call went tells where a cache holds something, like a hit)
            },
            "spans": [],
        }
        if self.migrations:
            out["migrations"] = self.migrations
        if not cache_outcomes:
            del out["cache"]
        for s in spans:
            attrs = s.attrs if cache_outcomes else {k: v for k, v in s.attrs.items() if k not in CACHE_OUTCOME_ATTRS}
            span = {"name": s.name, "start_ms": _ms(s.start - self.start), "duration_ms": _ms(s.duration_s)}
            out["spans"].append({**span, **({"attrs": attrs} if attrs else {})})
        return out

    def log_line(self) -> str:
        return json.dumps({"event": "prism.request", **self.summary()}, separators=(",", ":"), sort_keys=False)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _quantiles(sorted_values: list[float]) -> dict[str, float] | None:
    if not sorted_values:
        return None
    n = len(sorted_values)

    def q(p: float) -> float:
        return _ms(sorted_values[min(n - 1, int(p * (n - 1) + 0.5))])

    return {"mean": _ms(sum(sorted_values) / n), "p50": q(0.5), "p95": q(0.95), "max": _ms(sorted_values[-1])}
