"""``make bench``'s serving figures, each read from the raw runs of :mod:`loadtest.bench_sessions`:

* ``ttft_ratio_epd_vs_monolith`` — p50 TTFT, one medium image per request, light open-loop load; Prism / monolith.
* ``text_ttft_p95_flood_vs_idle`` — p95 TTFT of text-only probes while large images flood / idle (Prism; the
  monolith's figure beside it). One tenant floods and probes: quotas cannot help, the stage budgets and the prefill
  lane must.
* ``tenant_ttft_p95_flood_vs_idle`` — the same with two tenants and no quota set (what a new user gets): ``alpha``
  floods, ``beta`` probes; Prism only.
* ``tenants3_ttft_p95_flood_vs_idle`` — three tenants: ``alpha`` and ``gamma`` flood at once, each as hard as
  ``alpha`` alone above; ``beta`` probes.
* ``goodput_ratio_vs_naive`` and ``goodput_ratio_vs_monolith`` — peak goodput (the most requests meeting the TTFT
  and ITL SLOs per second at any swept rate of the same mixed open-loop load, :mod:`loadtest.sweep`), Prism / naive
  and Prism / monolith. The raw holds every server's curve, capacity and peak, and each server's goodput at the naive
  server's knee (where the figure was once read: a ratio there rewards the baseline's collapse).

and :func:`panels`, every load behind a figure for the TTFT CDF plot. The three flood figures of a run share one idle
side: the text flood figure's idle probes (idle, which key sends a probe changes nothing; the tenant figures sent
their own until 2026-12-05).
"""

from __future__ import annotations

from typing import Any

from loadtest import bench_loads as loads
from loadtest.bench_sessions import ServerRuns
from loadtest.figures import record
from loadtest.stats import RequestRecord, outcome_counts
from loadtest.sweep import KEEP_UP


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
    name, flood, probes = "tenant_ttft_p95_flood_vs_idle", "alpha_flood_load", "beta flood probes"
    # (alpha_quota: none — fair sharing by default is what the figure measures)
    return _beta_figure(name, prism.tenants, flood, probes, alpha_quota=None)


def tenants3_flood(prism: ServerRuns) -> dict[str, Any]:
    """Beta's text under two tenants' floods at once (alpha's and gamma's, each as large as the two-tenant figure's),
    against the same run's idle probes; no quota."""
    flood, probes = "alpha_and_gamma_flood_load", "beta probes under two floods"
    return _beta_figure("tenants3_ttft_p95_flood_vs_idle", prism.tenants3, flood, probes)


def _beta_figure(name: str, runs: list, flood: str, probes: str, **more: Any) -> dict[str, Any]:
    """A tenant figure: tenant beta's probe p95 under the flood over the run's idle probes, per run; ``flood`` /
    ``probes`` name the flood's outcomes in the raw and the flooded probes' side."""
    raw = [
        {
            "idle_p95_s": loads.ttft(b.idle, "p95"),
            "beta_flood_p95_s": loads.ttft(b.probes, "p95"),
            flood: outcome_counts(b.flood),
            **more,
        }
        for b in runs
    ]
    sides = {"idle probes": _flatten([b.idle for b in runs]), probes: _flatten([b.probes for b in runs])}
    return record(name, [b.ratio for b in runs], raw, sides=sides)


def knee_rate(naive: ServerRuns) -> float | None:
    """The naive server's knee — the first swept rate it cannot carry; ``None`` if it carries them all."""
    return loads.curve(naive.sweep)["knee_rps"]


def sweeps(naive: ServerRuns, prism: ServerRuns, mono: ServerRuns) -> dict[str, list[dict[str, Any]]]:
    """Every server's row at every rate it ran (the goodput plot's curves)."""
    return {name: loads.curve(runs.sweep)["sweep"] for name, runs in _servers(naive, prism, mono).items()}


def _servers(naive: ServerRuns, prism: ServerRuns, mono: ServerRuns) -> dict[str, ServerRuns]:
    return {"prism": prism, "monolith": mono, "naive": naive}


def goodput(naive: ServerRuns, prism: ServerRuns, mono: ServerRuns) -> dict[str, dict[str, Any]]:
    """Both peak-goodput ratios. Each compared side must be healthy at the lowest rate (errors there mean a broken
    server, not an overloaded one: the figure is invalid); past its capacity, errors and timeouts are the result."""
    curves = {name: loads.curve(runs.sweep) for name, runs in _servers(naive, prism, mono).items()}
    at = curves["naive"]["knee_rps"]
    raw = {
        "slo": prism.sweep[min(prism.sweep)][0]["slo"],
        "keep_up_slo_attainment": KEEP_UP,
        "servers": {name: {k: v for k, v in c.items() if k != "sweep"} for name, c in curves.items()},
        "at_naive_knee": {
            "rate_rps": at,
            **{name: _goodput_at(c["sweep"], at) for name, c in curves.items()},
        },
        "sweep": {name: c["sweep"] for name, c in curves.items()},
    }
    mono_raw = {"servers": raw["servers"], "curves": "in goodput_ratio_vs_naive's raw"}
    return {
        "goodput_ratio_vs_naive": _peak_ratio("naive", prism, naive, curves, raw),
        "goodput_ratio_vs_monolith": _peak_ratio("monolith", prism, mono, curves, mono_raw),
    }


def _peak_ratio(
    other: str, prism: ServerRuns, runs: ServerRuns, curves: dict[str, dict[str, Any]], raw: dict[str, Any]
) -> dict[str, Any]:
    mine, theirs = curves["prism"]["peak_goodput_rps"], curves[other]["peak_goodput_rps"]
    return record(
        f"goodput_ratio_vs_{other}",
        [loads.ratio(mine, theirs)],
        raw,
        sides={
            "prism at the lowest rate": prism.sweep[min(prism.sweep)][1],
            f"{other} at the lowest rate": runs.sweep[min(runs.sweep)][1],
        },
        goodput={"prism at its peak": mine, f"{other} at its peak": theirs},
    )


def _goodput_at(rows: list[dict[str, Any]], rate: float | None) -> float | None:
    return next((r["goodput_rps"] for r in rows if r["rate_rps"] == rate), None)


def panels(
    naive: ServerRuns, prism: ServerRuns, mono: ServerRuns, cache: tuple[list, list], cache_model: str
) -> dict[str, dict[str, list[RequestRecord]]]:
    """Every load behind a figure, by panel of the TTFT CDF plot."""
    cache_cold, cache_hot = cache
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
        "tenant beta's text probes under alpha's flood (p95 figure; idle: the panel above)": {
            **{f"alpha flooding #{i + 1}": b.probes for i, b in enumerate(prism.tenants)},
        },
        **{
            f"goodput sweep: {name}": {f"{r:g} rps": runs.sweep[r][1] for r in sorted(runs.sweep)}
            for name, runs in _servers(naive, prism, mono).items()
        },
    }
