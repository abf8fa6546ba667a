"""``make bench``'s serving figures, each read from the raw runs of :mod:`loadtest.bench_sessions`:

* ``ttft_ratio_epd_vs_monolith`` — p50 TTFT, one medium image per request, light open-loop load; Prism / monolith.
* ``text_ttft_p95_flood_vs_idle`` — p95 TTFT of text-only probes while large images flood / idle (Prism; the
  monolith's figure beside it). One tenant floods and probes: quotas cannot help, the stage budgets and the prefill
  lane must.
* ``tenant_ttft_p95_flood_vs_idle`` — the same with two tenants and no quota set (what a new user gets): ``alpha``
  floods, ``beta`` probes; Prism only.
* ``goodput_ratio_vs_naive`` — goodput (requests meeting the TTFT and ITL SLOs per second) under the same mixed
  open-loop load, Prism / naive, at the naive server's knee (:mod:`loadtest.sweep`); every rate's goodput is in the
  raw.

and :func:`panels`, every load behind a figure for the TTFT CDF plot.
"""

from __future__ import annotations

from typing import Any

from loadtest import bench_loads as loads
from loadtest.bench_sessions import NaiveRuns, ServerRuns
from loadtest.figures import record
from loadtest.stats import RequestRecord, outcome_counts
from loadtest.sweep import KEEP_UP, capacity, knee


def _flatten(runs: list[list[RequestRecord]]) -> list[RequestRecord]:
    return [r for run in runs for r in run]


def ttft_ratio(prism: ServerRuns, mono: ServerRuns) -> dict[str, Any]:
    pairs = list(zip(prism.cold, mono.cold, strict=True))
    raw = [
        {
            "prism_ttft_p50_s": loads.ttft(p),
            "monolith_ttft_p50_s": loads.ttft(m),
            "requests": len(p),
            "prism_stage_ms_mean": loads.stages(p),
            "monolith_stage_ms_mean": loads.stages(m),
        }
        for p, m in pairs
    ]
    values = [loads.ratio(loads.ttft(p), loads.ttft(m)) for p, m in pairs]
    sides = {"prism": _flatten(prism.cold), "monolith": _flatten(mono.cold)}
    return record("ttft_ratio_epd_vs_monolith", values, raw, sides=sides)


def text_flood(prism: ServerRuns, mono: ServerRuns) -> dict[str, Any]:
    raw = [
        {
            "prism_idle_p95_s": loads.ttft(f.idle, "p95"),
            "prism_flood_p95_s": loads.ttft(f.probes, "p95"),
            "prism_flood_load": outcome_counts(f.flood),  # its 429s are admission at work, not errors
            "monolith_ratio": m.ratio,
            "monolith_idle_p95_s": loads.ttft(m.idle, "p95"),
            "monolith_flood_p95_s": loads.ttft(m.probes, "p95"),
            "monolith_probes": outcome_counts(m.probes),
            "monolith_flood_load": outcome_counts(m.flood),
        }
        for f, m in zip(prism.floods, mono.floods, strict=True)
    ]
    sides = {
        "idle probes": _flatten([f.idle for f in prism.floods]),
        "flood probes": _flatten([f.probes for f in prism.floods]),
    }
    return record("text_ttft_p95_flood_vs_idle", [f.ratio for f in prism.floods], raw, sides=sides)


def tenant_flood(prism: ServerRuns) -> dict[str, Any]:
    raw = [
        {
            "beta_idle_p95_s": loads.ttft(b.idle, "p95"),
            "beta_flood_p95_s": loads.ttft(b.probes, "p95"),
            "alpha_flood_load": outcome_counts(b.flood),
            "alpha_quota": None,  # (none: fair sharing by default is what the figure measures)
        }
        for b in prism.tenants
    ]
    sides = {
        "beta idle probes": _flatten([b.idle for b in prism.tenants]),
        "beta flood probes": _flatten([b.probes for b in prism.tenants]),
    }
    return record("tenant_ttft_p95_flood_vs_idle", [b.ratio for b in prism.tenants], raw, sides=sides)


def knee_rate(naive: NaiveRuns) -> float:
    """The naive server's knee — the first swept rate it cannot carry; the top rate if it carries them all — where
    the goodputs are compared."""
    return knee([(r, naive.sweep[r][0]["slo_attainment"]) for r in naive.rates]) or naive.rates[-1]


def sweeps(naive: NaiveRuns, prism: ServerRuns, mono: ServerRuns) -> dict[str, list[dict[str, Any]]]:
    """Every server's row at every swept rate (the goodput plot's curves)."""
    runs = (("prism", prism.sweep), ("monolith", mono.sweep), ("naive", naive.sweep))
    return {name: [loads.sweep_row(r, sweep[r]) for r in naive.rates] for name, sweep in runs}


def goodput(naive: NaiveRuns, prism: ServerRuns, mono: ServerRuns) -> dict[str, Any]:
    """Both sides must be healthy at the lowest rate (errors there mean a broken server, not an overloaded one: the
    figure is invalid); at the knee, errors and timeouts are part of the result."""
    at, low = knee_rate(naive), naive.rates[0]
    prism_good, naive_good = prism.sweep[at][0]["goodput_rps"], naive.sweep[at][0]["goodput_rps"]
    points = [(r, naive.sweep[r][0]["slo_attainment"]) for r in naive.rates]
    raw = {
        "compared_at_rps": at,
        "naive_capacity_rps": capacity(points),
        "naive_ramp": [{"rate_rps": r, "slo_attainment": a} for r, a in naive.ramp],
        "slo": prism.sweep[at][0]["slo"],
        "keep_up_slo_attainment": KEEP_UP,
        "sweep": sweeps(naive, prism, mono),
    }
    return record(
        "goodput_ratio_vs_naive",
        [loads.ratio(prism_good, naive_good)],
        raw,
        sides={"prism at the lowest rate": prism.sweep[low][1], "naive at the lowest rate": naive.sweep[low][1]},
        goodput={"prism at the knee": prism_good, "naive at the knee": naive_good},
    )


def panels(
    naive: NaiveRuns, prism: ServerRuns, mono: ServerRuns, cache: tuple[list, list], cache_model: str
) -> dict[str, dict[str, list[RequestRecord]]]:
    """Every load behind a figure, by panel of the TTFT CDF plot."""
    cache_cold, cache_hot = cache
    sweep_runs = (("prism", prism.sweep), ("monolith", mono.sweep), ("naive", naive.sweep))
    return {
        "light load, medium images (p50 figures)": {
            **{f"prism cold #{i + 1}": r for i, r in enumerate(prism.cold)},
            **{f"monolith cold #{i + 1}": r for i, r in enumerate(mono.cold)},
        },
        f"cache reach, {cache_model} (p50 figure)": {
            **{f"cold #{i + 1}": r for i, r in enumerate(cache_cold)},
            **{f"hot, new questions #{i + 1}": r for i, r in enumerate(cache_hot)},
        },
        "text probes, one tenant (p95 figure)": {
            **{f"prism idle #{i + 1}": f.idle for i, f in enumerate(prism.floods)},
            **{f"prism flood #{i + 1}": f.probes for i, f in enumerate(prism.floods)},
            **{f"monolith flood #{i + 1}": m.probes for i, m in enumerate(mono.floods)},
        },
        "tenant beta's text probes (p95 figure)": {
            **{f"idle #{i + 1}": b.idle for i, b in enumerate(prism.tenants)},
            **{f"alpha flooding #{i + 1}": b.probes for i, b in enumerate(prism.tenants)},
        },
        **{f"goodput sweep: {name}": {f"{r:g} rps": sweep[r][1] for r in naive.rates} for name, sweep in sweep_runs},
    }
