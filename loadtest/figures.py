"""Every figure ``make bench`` reports, declared in one place: its target, who set it, and how many runs it takes.

A figure whose load is short (tens of requests: a p50 or p95 over 10–40 requests moves by tens of percent on these
shared machines) is measured :attr:`Figure.runs` times, each run with inputs of its own (fresh images: cold caches
stay cold); its value is the **median** of the runs, and ``values`` and ``spread`` (min, max, and max − min over the
median) travel with it into ``summary.json``. Every side's outcome counts are summed over the runs, and the figure is
judged once on the sums (:func:`loadtest.verdict.judge`); a run that gave no finite value makes the figure invalid —
a median that quietly drops failed runs would be a best-of in disguise.

``make bench BENCH_FLAGS=--quick`` runs each figure once, on shorter loads, for iteration: its summary is written
apart and the docs are left alone. Run counts are odd, so a median is always one of the runs — the same run whichever
module picks it (:func:`median_index`).

A new figure: declare it in :data:`FIGURES`, then measure it in :mod:`loadtest.bench` and pass its per-run values to
:func:`record`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.stats import RequestRecord, outcome_counts
from loadtest.verdict import judge


@dataclass(frozen=True)
class Figure:
    name: str
    op: str  # "<=" or ">="
    target: float
    runs: int = 1
    """Runs in a full ``make bench`` (``--quick``: one)."""
    ours: bool = False
    """A yardstick of ours; the others are the targets the issues set (issue 8: the TTFT ratio, the decode speedup,
    the text flood, goodput vs naive; 15: the cache-reach three; 20: the hand-offs; 32: NIXL over UCX's READ; 33: the
    topology two (``MEPD``'s TTFT is held to ``EPD``'s target: ours); 34: the tenant flood; 35: the grammar masks;
    37: the roofline and the speedup over batch 1)."""

    def __post_init__(self) -> None:
        if self.runs < 1 or self.runs % 2 == 0:  # an odd count: the median is one of the runs, the same everywhere
            raise ValueError(f"{self.name}: runs must be odd, not {self.runs}")

    @property
    def target_text(self) -> str:
        return f"{self.op} {self.target:g}"


FIGURES: tuple[Figure, ...] = (
    Figure("decode_speedup_32_vs_sequential", ">=", 10.0, runs=3),
    Figure("decode_speedup_32_vs_engine_b1", ">=", 10.0, runs=3),
    Figure("decode_roofline_fraction_b32", ">=", 0.6, runs=3),
    Figure("grammar_mask_fraction_of_b32_step", "<=", 0.10, runs=3),
    Figure("handoff_bw_fraction_of_memcpy", ">=", 0.4, runs=5),
    Figure("nixl_bw_fraction_of_memcpy", ">=", 0.25, runs=5),
    Figure("nixl_vs_ucx_read", ">=", 0.8, runs=5),
    Figure("ttft_ratio_epd_vs_monolith", "<=", 1.10, runs=3),
    Figure("ttft_ratio_topology_epd_vs_monolith", "<=", 1.05, runs=3),
    Figure("ttft_ratio_topology_mepd_vs_monolith", "<=", 1.05, runs=3, ours=True),
    Figure("ttft_ratio_topology_mepd_in_ingress_vs_monolith", "<=", 1.05, runs=3, ours=True),
    Figure("encoder_cache_hot_cold_ttft_ratio", "<=", 0.5, runs=3),
    Figure("encoder_hit_rate_2_replicas", ">=", 0.9, runs=3),
    Figure("prefix_reuse_fraction", ">=", 0.8, runs=3),
    Figure("text_ttft_p95_flood_vs_idle", "<=", 1.5, runs=3),
    Figure("tenant_ttft_p95_flood_vs_idle", "<=", 3.0, runs=3),
    Figure("tenants3_ttft_p95_flood_vs_idle", "<=", 3.0, runs=3),
    # One sweep: each of its points is a run of >= 20 requests, and the sweep itself spans up to 6 rates per server.
    Figure("goodput_ratio_vs_naive", ">=", 3.0, runs=1),
    Figure("goodput_ratio_vs_monolith", ">=", 1.0, runs=1, ours=True),
    Figure("peak_goodput_best_topology_vs_monolith", ">=", 1.0, runs=1),
)
BY_NAME = {f.name: f for f in FIGURES}


def runs(name: str, quick: bool = False) -> int:
    return 1 if quick else BY_NAME[name].runs


def median_index(values: Sequence[float]) -> int:
    """Index of the median of ``values`` (the lower middle one of an even count): where a figure's other numbers
    must come from the same run as its median (:mod:`loadtest.bench_decode`, :mod:`loadtest.bench_transfer`)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def bandwidth(nbytes: int, seconds: Sequence[float], memcpy: float) -> dict[str, Any]:
    """A transfer of ``nbytes`` timed ``seconds`` per repeat: the median repeat's time and bandwidth, as a fraction of
    ``memcpy`` (bytes/s measured in the same run), and every repeat's fraction."""
    median = seconds[median_index(seconds)]
    return {
        "bytes": nbytes,
        "seconds": median,
        "repeats": len(seconds),
        "bytes_per_s": nbytes / median,
        "memcpy_bytes_per_s": memcpy,
        "fraction_of_memcpy": nbytes / median / memcpy,
        "fractions": [nbytes / t / memcpy for t in seconds],
    }


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """min, max and their distance relative to the median (0.1: the runs span 10 % of the value; ``None`` when the
    median is 0)."""
    mid = values[median_index(values)]
    lo, hi = min(values), max(values)
    return {"min": lo, "max": hi, "relative": (hi - lo) / abs(mid) if mid else None}


def record(
    name: str,
    values: Sequence[float | None],
    raw: dict[str, Any] | Sequence[dict[str, Any]],
    note: str = "",
    sides: dict[str, list[RequestRecord]] | None = None,
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One figure of ``summary.json`` from its runs: ``values`` one per run, ``raw`` the numbers they came from (one
    dict for all runs, or one per run); ``sides`` maps a side's name to its records over all runs, ``goodput`` a side's
    name to its goodput (:func:`loadtest.verdict.judge`)."""
    fig = BY_NAME[name]
    raws = [raw] if isinstance(raw, dict) else list(raw)
    if not values or len(raws) not in (1, len(values)):
        raise ValueError(f"{name}: {len(values)} values, {len(raws)} raw dicts (one, or one per run)")
    finite = [v for v in values if v is not None and math.isfinite(v)]
    value = finite[median_index(finite)] if len(finite) == len(values) else None
    counts = {side: outcome_counts(records) for side, records in (sides or {}).items()}
    status, reason = judge(value, fig.op, fig.target, counts, goodput)
    if len(finite) < len(values) and reason in ("", "no finite value"):
        # (a failed side, when there is one, says more about a missing value than the count of runs without one)
        status, reason = "invalid", f"{len(values) - len(finite)} of {len(values)} runs gave no finite value"
    out: dict[str, Any] = {"value": value, "target": fig.target_text, "met": status == "met", "status": status}
    if reason:
        out["invalid_reason"] = reason
    out["runs"] = len(values)
    if len(values) > 1:
        out["values"] = list(values)
        if finite:
            out["spread"] = spread(finite)
    if counts:
        out["sides"] = counts
    out["raw"] = raws[0] if len(raws) == 1 else {"runs": list(raws)}
    return {**out, **({"note": note} if note else {})}
