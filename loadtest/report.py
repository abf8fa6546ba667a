"""A load run's report: ``report.json`` (summary + every request) and PNG plots.

Plots: ``latency_cdf.png`` (TTFT, ITL, E2E CDFs), ``ttft_vs_load.png`` (p50/p95 TTFT per offered rate when a run
sweeps several rates; per run otherwise) and ``stage_breakdown.png`` (mean milliseconds per Prism trace span, when
the endpoint returned traces). Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.stats import RequestRecord


def write_report(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[Path]:
    """``runs``: one dict per rate with ``label``, ``offered_rps``, ``summary`` and ``records``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "runs": [
            {
                "label": r["label"],
                "offered_rps": r["offered_rps"],
                "summary": r["summary"],
                "requests": [rec.to_json() for rec in r["records"]],
            }
            for r in runs
        ]
    }
    paths = [out_dir / "report.json"]
    paths[0].write_text(json.dumps(doc, indent=1, default=float) + "\n", encoding="utf-8")
    paths.append(_cdf(out_dir / "latency_cdf.png", runs))
    paths.append(_ttft_vs_load(out_dir / "ttft_vs_load.png", runs))
    paths.append(_stages(out_dir / "stage_breakdown.png", runs))
    return paths


def _cdf(path: Path, runs: Sequence[dict[str, Any]]) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run in runs:
        ok: list[RequestRecord] = [r for r in run["records"] if r.ok]
        series = {
            "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
            "ITL": [g for r in ok for g in r.itl_s],
            "E2E": [r.e2e_s for r in ok if r.e2e_s is not None],
        }
        for ax, (name, values) in zip(axes, series.items(), strict=True):
            plot_cdf(ax, values, run["label"])
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
            ax.grid(True, alpha=0.3)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return save(fig, path)


def plot_cdf(ax: Any, seconds: Sequence[float], label: str) -> None:
    """The empirical CDF of ``seconds`` on ``ax``, in milliseconds (nothing drawn for no values)."""
    xs = sorted(seconds)
    if xs:  # (markers on short runs: a run of one or two requests is otherwise an invisible dot or a bare segment)
        marker = "." if len(xs) < 30 else None
        ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label, marker=marker)


def _ttft_vs_load(path: Path, runs: Sequence[dict[str, Any]]) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["offered_rps"] if r["offered_rps"] is not None else i for i, r in enumerate(runs)]
    for p in ("p50", "p95"):
        ys = [(r["summary"]["ttft_s"][p] or 0) * 1000 for r in runs]
        ax.plot(xs, ys, marker="o", label=f"TTFT {p}")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("ms")
    ax.set_title("TTFT vs load")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save(fig, path)


def _stages(path: Path, runs: Sequence[dict[str, Any]]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    names: list[str] = []
    for run in runs:
        names += [n for n in run["summary"]["stage_ms_mean"] if n not in names]
    bottoms = [0.0] * len(runs)
    for name in names:
        values = [run["summary"]["stage_ms_mean"].get(name, 0.0) for run in runs]
        ax.bar([r["label"] for r in runs], values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("mean ms per request")
    ax.set_title("Per-stage breakdown (Prism traces)" if names else "Per-stage breakdown (no traces returned)")
    if names:
        ax.legend(fontsize=7, ncol=2)
    return save(fig, path)


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
