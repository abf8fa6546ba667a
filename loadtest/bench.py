"""``make bench``: Prism against a monolith and a naive transformers server, side by side in one run.

Everything runs on this machine, one server at a time (so they never share the cores), with the same model
(``prism-small-llava`` unless ``--model``), the same workloads and seeds. Writes ``loadtest/results/summary.json``
(each figure with the raw numbers it came from and its target), the plots (:mod:`loadtest.bench_plots`), the table
in ``docs/benchmarks.md`` and the README's topology table (:mod:`loadtest.readme_table`), and prints the path last.
Each figure's target and number of runs are declared in :mod:`loadtest.figures`: short figures run three times or
more (median, spread beside it), interleaved, each run with images of its own. ``--quick`` runs each figure once on
shorter loads and writes to ``loadtest/results/quick/``.

The run, in order — each step readable on its own:

1. the decode engine, the grammar masks and the KV hand-offs, in process (:mod:`loadtest.bench_engine`);
2. the server sessions — naive, Prism, Prism's cache-reach application, Prism in each grouped topology
   (:mod:`loadtest.bench_topology`), monolith (:mod:`loadtest.bench_sessions`);
3. the serving figures read from those runs (:mod:`loadtest.bench_results`; the cache-reach ones:
   :mod:`loadtest.bench_cache`), the plots, the summary and the table (here).

A figure is ``invalid`` — never met — when a side it compares sent nothing, failed more than 1 % of its requests,
or had zero goodput (:mod:`loadtest.verdict`); each figure carries every side's ok / error / timeout counts. The
baselines' output goes to ``loadtest/results/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest import (
    bench_cache,
    bench_engine,
    bench_hops,
    bench_plots,
    bench_results,
    bench_topology,
    figures,
    machine,
    readme_table,
)
from loadtest import bench_servers as servers
from loadtest import bench_sessions as sessions
from loadtest.bench_settings import Settings
from loadtest.sweep import KEEP_UP

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
"""Where the table of a full run goes (between the bench markers)."""
QUICK = RESULTS / "quick"
"""Where ``--quick`` writes (not committed; the docs are left alone)."""

__all__ = ["Settings", "main", "table", "update_doc"]


def app_config(model: str) -> dict[str, Any]:
    """The Prism application (and the monolith's config) every serving figure runs against."""
    return {
        "model": {"model": model, "torch_threads": 1},
        "deployments": {s: {"num_cpus": 0.25} for s in ("media", "encode", "prefill", "decode")},
        "server": {
            "api_keys": {servers.KEY: "bench", servers.ALPHA: "alpha", servers.BETA: "beta", servers.GAMMA: "gamma"}
        },
        "observability": {"trace_cache_hits": True},
    }


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--cache-model", default=bench_cache.MODEL, help="the cache-reach figures' model")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds per load run (20; --quick: 8); a sweep's runs at most 16"
    )
    parser.add_argument("--quick", action="store_true", help="every figure once, short loads; docs left alone")
    parser.add_argument("--out", type=Path, default=None, help="summary.json (default: loadtest/results/[quick/])")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = _args(argv)
    st = Settings(args.quick, args.duration)
    out = args.out or (QUICK if st.quick else RESULTS) / "summary.json"
    started = time.time()

    def say(msg: str) -> None:
        print(f"[bench {time.time() - started:5.0f}s] {msg}", file=sys.stderr, flush=True)

    metrics, plots, slo, hops = _measure(args.model, args.cache_model, st, out.parent, say)
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine.facts(),
        "model": args.model,
        "cache_model": args.cache_model,
        "quick": st.quick,
        "duration_s_per_run": st.duration,
        "sweep_duration_s_per_run": st.sweep_duration,
        "slo": {"goodput": slo, "keep_up_slo_attainment": KEEP_UP},
        "wall_s": round(time.time() - started, 1),
        "plots": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in plots],
        "metrics": {f.name: metrics[f.name] for f in figures.FIGURES},
        "per_hop_fixed_cost": hops,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    if not st.quick:
        update_doc(summary)
        readme_table.rewrite(ROOT / "README.md", summary)  # (the README's topology table: never typed by hand)
    say("done")
    print(out)
    return out


def _cpu(machine_facts: dict[str, Any]) -> str:
    """`` of <model> (<kernel flags>)`` for the docs' line, when the summary records them."""
    model, flags = machine_facts.get("cpu_model"), machine_facts.get("kernel_flags")
    if not model:
        return ""
    return f" of {model}" + (f" ({', '.join(flags)})" if flags else "")


def _measure(
    model: str, cache_model: str, st: Settings, plots_dir: Path, say: sessions.Say
) -> tuple[dict[str, Any], list[Path], dict[str, Any], dict[str, Any]]:
    """Every figure (see the module docstring), the plots, the goodput SLOs and the per-hop reports."""
    say("decode engine")
    decode_out = (QUICK if st.quick else RESULTS) / "decode.json"
    n_decode = st.runs("decode_speedup_32_vs_sequential")  # (the roofline comes from the same runs: declared alike)
    metrics = bench_engine.decode_figures(model, n_decode, st.decode_tokens, decode_out)
    say("grammar masks (structured outputs)")
    grammar_out = (QUICK if st.quick else RESULTS) / "grammar.json"
    steps = 8 if st.quick else 24
    metrics.update(
        bench_engine.grammar_figures(model, st.runs("grammar_mask_fraction_of_b32_step"), steps, grammar_out)
    )
    say("transfers (object store, NIXL, UCX's own READ), in a Ray session of their own")
    runs = st.runs("handoff_bw_fraction_of_memcpy"), st.runs("nixl_bw_fraction_of_memcpy")
    metrics.update(bench_engine.transfer_figures(*runs, st.ucx_transports))
    config = app_config(model)
    naive = sessions.naive_session(model, st, say)
    at = bench_results.knee_rate(naive)
    also = (at,) if at is not None else ()  # (each server's goodput at the naive server's knee stays in the raw)
    prism = sessions.prism_session(config, model, st, say, also)
    cache = sessions.cache_session(config, cache_model, st, say)
    grouped = bench_topology.session(config, model, st, say)
    mono = sessions.monolith_session(config, model, st, say, also)
    metrics["ttft_ratio_epd_vs_monolith"] = bench_results.ttft_ratio(prism, mono)
    metrics.update(bench_cache.figures(cache_model, *cache))
    metrics["text_ttft_p95_flood_vs_idle"] = bench_results.text_flood(prism, mono)
    metrics["tenant_ttft_p95_flood_vs_idle"] = bench_results.tenant_flood(prism)
    metrics["tenants3_ttft_p95_flood_vs_idle"] = bench_results.tenants3_flood(prism)
    metrics.update(bench_results.goodput(naive, prism, mono))
    curves = bench_results.sweeps(naive, prism, mono)
    panels = bench_results.panels(naive, prism, mono, cache, cache_model)
    topology, topology_plot = bench_topology.figures(prism, mono, grouped, plots_dir)
    metrics.update(topology)
    plots = [
        bench_plots.goodput_vs_rate(plots_dir / bench_plots.GOODPUT_PNG, curves, at),
        topology_plot,
        bench_plots.ttft_cdfs(plots_dir / bench_plots.TTFT_PNG, panels),
    ]
    slo = prism.sweep[min(prism.sweep)][0]["slo"]
    return metrics, plots, slo, {"prism": prism.hops, "monolith": mono.hops}


def table(summary: dict[str, Any], doc_dir: Path = DOC.parent) -> str:
    """The figures of ``summary`` as a Markdown table (plots linked relative to ``doc_dir``)."""
    rows = ["| Figure | Value | Runs (min–max) | Target | Met |", "|---|---|---|---|---|"]
    for name, m in summary["metrics"].items():
        fig = figures.BY_NAME.get(name)
        target = m["target"] + (" (ours)" if fig is not None and fig.ours else "")
        value = "—" if m["value"] is None else f"{m['value']:.3g}"
        runs = str(m.get("runs", 1))  # (summaries written before repeats say nothing: one run)
        if "spread" in m:
            runs += f" ({m['spread']['min']:.3g}–{m['spread']['max']:.3g})"
        status = m.get("status", "met" if m["met"] else "missed")  # (summaries written before the status field)
        met = {"met": "yes", "missed": "no"}.get(status, f"invalid: {m.get('invalid_reason', '')}")
        rows.append(f"| `{name}` | {value} | {runs} | {target} | {met} |")
    head = (
        f"Measured {summary['date'][:10]} on {summary['machine']['cpus']} CPUs{_cpu(summary['machine'])} "
        f"({summary['machine']['platform']}), "
        f"model `{summary['model']}`, {summary['wall_s']:.0f} s wall; raw figures in `loadtest/results/summary.json`."
    )
    plots = ", ".join(
        f"[{Path(p).stem.removeprefix('bench_').replace('_', ' ')}]({os.path.relpath(ROOT / p, doc_dir)})"
        for p in summary.get("plots", [])
    )
    hops = bench_hops.table(summary.get("per_hop_fixed_cost") or {})
    hops = f"\n\nThe fixed cost of each hop (`loadtest/bench_hops.py`):\n\n{hops}" if hops else ""
    return head + "\n\n" + "\n".join(rows) + (f"\n\nPlots: {plots}." if plots else "") + hops


START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def update_doc(summary: dict[str, Any], doc: Path = DOC) -> None:
    """Replace the block between the bench markers of ``doc`` with the table of ``summary``."""
    text = doc.read_text(encoding="utf-8")
    block = f"{START}\n{table(summary, doc.parent)}\n{END}"
    doc.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S), "utf-8")


if __name__ == "__main__":
    main()
