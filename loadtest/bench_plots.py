"""``make bench``'s plots, linked from the table in ``docs/benchmarks.md`` beside ``summary.json``.

* ``bench_goodput_vs_rate.png`` — goodput (requests/s meeting the SLOs) against offered load, one line per server,
  the offered rate itself as the ceiling, and the naive server's knee (where the ratio is read) marked.
* ``bench_topology_goodput.png`` — the same, one line per topology of the model's stages and the monolith
  (:mod:`loadtest.bench_topology`).
* ``bench_ttft_cdf.png`` — TTFT CDF of every load run behind a latency figure, one panel per figure (each repeat
  its own line) and one per server of the goodput sweep (each rate its own line): what a p50 or p95 leaves out.

Matplotlib's Agg backend (:mod:`loadtest.report`): no display needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from loadtest.report import plot_cdf, plt, save
from loadtest.stats import RequestRecord

GOODPUT_PNG, TTFT_PNG = "bench_goodput_vs_rate.png", "bench_ttft_cdf.png"


def goodput_vs_rate(
    path: Path,
    sweeps: dict[str, list[dict[str, Any]]],
    knee_rps: float | None,
    title: str = "Goodput vs offered load (mixed workload)",
) -> Path:
    """``sweeps``: server (or topology) → its :func:`loadtest.bench_loads.sweep_row` rows."""
    fig, ax = plt.subplots(figsize=(6, 4))
    top = 0.0
    for server, rows in sweeps.items():
        rates = [r["rate_rps"] for r in rows]
        ax.plot(rates, [r["goodput_rps"] for r in rows], marker="o", label=server)
        top = max([top, *rates])
    if top:
        ax.plot([0, top], [0, top], color="grey", linestyle=":", label="offered")
    if knee_rps is not None:
        ax.axvline(knee_rps, color="grey", linestyle="--", label=f"naive knee ({knee_rps:g} rps)")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLOs)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def ttft_cdfs(path: Path, panels: dict[str, dict[str, list[RequestRecord]]]) -> Path:
    """``panels``: a panel's title → run label → that run's records (TTFT of the ok ones)."""
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (title, runs) in zip(flat, panels.items(), strict=False):
        for label, records in runs.items():
            plot_cdf(ax, [r.ttft_s for r in records if r.ok and r.ttft_s is not None], label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    return save(fig, path)
