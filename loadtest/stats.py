"""Statistics of a load run: percentiles, throughput, goodput under SLOs, outcomes by code.

Percentiles use linear interpolation between closest ranks (numpy's default "linear" method), so p50 of [1, 2, 3, 4]
is 2.5. Goodput counts requests that succeeded *and* met every SLO (TTFT and mean inter-token latency), per second
of the run: the rate at which users got a good answer, not the rate at which the server produced tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds; ``None`` where it does not apply)."""

    kind: str
    sent_at: float
    status: int
    code: str = "ok"
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    trace: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.code == "ok"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E − TTFT) / (tokens − 1)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"tpot_s": self.tpot_s}


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "count": len(values),
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    itl_s: float = 0.2
    """Bound on a request's mean inter-token latency."""

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return not r.itl_s or sum(r.itl_s) / len(r.itl_s) <= self.itl_s


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    by_kind = Counter(r.kind for r in records)
    outcomes = Counter(f"{r.status} {r.code}" for r in records)
    tokens = sum(r.output_tokens for r in ok)
    good = sum(slo.met(r) for r in records)
    return {
        "requests": len(records),
        "ok": len(ok),
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else 0.0,
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "slo": asdict(slo),
        "slo_attainment": good / len(records) if records else None,
        "outcomes": dict(sorted(outcomes.items())),
        "rejected_429": sum(r.status == 429 for r in records),
        "by_kind": dict(sorted(by_kind.items())),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "ttft_s_by_kind": {
            k: distribution([r.ttft_s for r in ok if r.kind == k and r.ttft_s is not None]) for k in sorted(by_kind)
        },
        "stage_ms_mean": stage_breakdown(ok),
    }


TIMEOUT_CODES = frozenset({"client_timeout", "deadline_exceeded"})
"""Codes of a request that ran out of time (the client's own timeout, or the server's deadline: 504)."""


def outcome_counts(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What one side of a figure did: requests sent, ok, errors (every non-ok outcome, timeouts included) and
    timeouts. A figure's percentiles use the ok requests only, so these say what they leave out."""
    ok = sum(r.ok for r in records)
    timeouts = sum((not r.ok) and r.code in TIMEOUT_CODES for r in records)
    errors = len(records) - ok
    return {
        "requests": len(records),
        "ok": ok,
        "errors": errors,
        "timeouts": timeouts,
        "error_fraction": round(errors / len(records), 4) if records else None,
    }


def stage_breakdown(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Mean milliseconds per Prism trace span (requests without a trace are left out)."""
    sums: dict[str, float] = {}
    n = 0
    for r in records:
        if not r.trace:
            continue
        n += 1
        for span in r.trace.get("spans", []):
            sums[span["name"]] = sums.get(span["name"], 0.0) + float(span["duration_ms"])
    return {k: v / n for k, v in sums.items()} if n else {}
