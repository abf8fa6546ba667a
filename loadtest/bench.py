"""``make bench``: Prism against a monolith and a naive transformers server, side by side in one run.

Everything runs on this machine, one server at a time (so they never share the cores), with the same model
(``prism-small-llava`` unless ``--model``), the same workloads and seeds. Writes ``loadtest/results/summary.json``
(each figure with the raw numbers it came from and its target), the plots (:mod:`loadtest.bench_plots`) and the
README table, and prints the path last. Each figure's target and number of runs are declared in
:mod:`loadtest.figures`: short figures run three times or more (median, spread beside it), interleaved, each run with
images of its own. ``--quick`` runs each figure once on shorter loads and writes to ``loadtest/results/quick/``.

Figures:

* ``ttft_ratio_epd_vs_monolith`` — p50 TTFT, one medium image per request, light open-loop load; Prism / monolith.
* ``handoff_bw_fraction_of_memcpy`` — a KV payload through the object store between two processes, from publish to
  the receiver's own buffers, / one warm memcpy; the lower of 64 MB and 256 MB (:mod:`loadtest.bench_transfer`; two
  copies: at most 0.5).
* ``nixl_bw_fraction_of_memcpy`` — the same over NIXL (UCX, DRAM to DRAM); beside it, what one READ between
  pre-registered buffers reaches with each UCX transport (:mod:`loadtest.bench_ucx`).
* ``decode_speedup_32_vs_sequential``, ``decode_roofline_fraction_b32`` — from :mod:`loadtest.bench_decode` (fp32;
  beside them, per dtype — fp32 and bf16 — step time, bytes per step, floor fraction and speedup at batch 1/8/32,
  the native vs PyTorch attention step, greedy agreement, and prefill against its FLOPs).
* ``encoder_cache_hot_cold_ttft_ratio``, ``encoder_hit_rate_2_replicas``, ``prefix_reuse_fraction`` — a few images
  asked new questions again and again / unique images, on ``prism-small-qwen2vl`` with 2 encode and 2 prefill
  replicas (Prism; :mod:`loadtest.bench_cache`).
* ``text_ttft_p95_flood_vs_idle`` — p95 TTFT of text-only probes while large images flood / idle (Prism; the
  monolith's figure beside it). One tenant floods and probes: quotas cannot help, the stage budgets and the
  prefill lane must.
* ``tenant_ttft_p95_flood_vs_idle`` — the same with two tenants: ``alpha`` (at most 2 requests with media in
  flight) floods, ``beta`` probes; Prism only.
* ``goodput_ratio_vs_naive`` — goodput (requests meeting the TTFT and ITL SLOs per second) under the same mixed
  open-loop load, Prism / naive, at the naive server's knee (:mod:`loadtest.sweep`): its capacity found first with
  a ramp, then all three servers swept at 0.5-4x of it, fresh images per run; every rate's goodput is in the raw.

A figure is ``invalid`` — never met — when a side it compares sent nothing, failed more than 1 % of its requests,
or had zero goodput (:mod:`loadtest.verdict`); each figure carries every side's ok / error / timeout counts. The
baselines' output goes to ``loadtest/results/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest import bench_cache, bench_plots, bench_ucx, figures
from loadtest import bench_loads as loads
from loadtest import bench_servers as servers
from loadtest.bench_loads import seed_of
from loadtest.figures import record
from loadtest.stats import RequestRecord, outcome_counts
from loadtest.sweep import KEEP_UP, MIN_REQUESTS, RAMP, capacity, knee, sweep_rates

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
README = ROOT / "README.md"
QUICK = RESULTS / "quick"
"""Where ``--quick`` writes (not committed; the README is left alone)."""


class Settings:
    """What a full run and a ``--quick`` one differ in (the figures' runs: :func:`loadtest.figures.runs`)."""

    def __init__(self, quick: bool, duration: float | None) -> None:
        self.quick = quick
        self.duration = duration if duration is not None else (8.0 if quick else 20.0)
        self.min_requests = 8 if quick else MIN_REQUESTS
        self.decode_tokens = 16 if quick else 32
        self.ucx_transports = {"default": None} if quick else bench_ucx.TRANSPORTS

    def runs(self, name: str) -> int:
        return figures.runs(name, self.quick)


def _transfers(st: Settings) -> dict[str, Any]:
    import ray

    from loadtest import bench_transfer

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:  # its own session: the NIXL agents' UCX threads must not linger beside the servers measured later
        store = bench_transfer.transport_figures("object_store", st.runs("handoff_bw_fraction_of_memcpy"))
        repeats = st.runs("nixl_bw_fraction_of_memcpy")
        nx = bench_transfer.transport_figures("nixl", repeats)
        size = bench_transfer.SIZES[-1]
        memcpy = nx["sizes"][str(size)]["memcpy_bytes_per_s"]
        nx["ucx_read"] = bench_ucx.figures(size, memcpy, repeats, st.ucx_transports)
    finally:
        ray.shutdown()
    note = "publish + fetch + copy into the receiver's pre-touched buffers; two copies: at most 0.5 (two_copy_floor)"
    nixl_note = note + "; ucx_read: one READ between pre-registered buffers, UCX's own ceiling (loadtest/bench_ucx.py)"
    return {
        "handoff_bw_fraction_of_memcpy": record("handoff_bw_fraction_of_memcpy", store["fractions"], store, note=note),
        "nixl_bw_fraction_of_memcpy": record("nixl_bw_fraction_of_memcpy", nx["fractions"], nx, note=nixl_note),
    }


def _decode(model: str, st: Settings) -> dict[str, Any]:
    from loadtest import bench_decode

    out = RESULTS / "decode.json" if not st.quick else QUICK / "decode.json"
    runs = st.runs("decode_speedup_32_vs_sequential")  # (the roofline comes from the same runs: declared alike)
    dec = bench_decode.main(
        ["--model", model, "--out", str(out), "--repeats", str(runs), "--tokens", str(st.decode_tokens)]
    )
    median_run = {
        "timed": "end to end on both sides: from the prefill output handed over (KV import included)",
        "engine_b32_e2e_tokens_per_s": dec["engine"]["32"]["e2e_tokens_per_s"],
        "sequential_e2e_tokens_per_s": dec["sequential"]["e2e_tokens_per_s"],
        "speedup_after_kv_import": dec["decode_speedup_32_vs_sequential_steps"],
        "engine_b32_tokens_per_s": dec["engine"]["32"]["tokens_per_s"],
        "sequential_tokens_per_s": dec["sequential"]["tokens_per_s"],
        "of_the_run": "the median one",
    }
    roofline = {
        "runs": [
            {"achieved_bytes_per_s": achieved, "memcpy_bytes_per_s": dec["memcpy_bytes_per_s"]}
            for achieved in dec["engine_b32_bytes_per_s_runs"]
        ],
        # what caps it on this machine: the b32 step's weight GEMMs alone, and the fraction a step could reach if
        # nothing but those GEMMs and the KV read at the memory floor took time
        "b32_weight_gemm_ms": dec["b32_weight_gemm_ms"],
        "b32_best_possible_floor_fraction": dec["b32_best_possible_floor_fraction"],
    }
    kept = ("per_batch", "attention_paths_b32_step_ms", "agreement_greedy", "prefill", "b32_weight_gemm_ms")
    kept += ("b32_best_possible_floor_fraction",)
    per_dtype = {dtype: {k: f[k] for k in kept} for dtype, f in dec["dtypes"].items()}
    median_run["per_dtype"] = per_dtype  # step time, bytes, floor fraction and speedup at 1/8/32; prefill vs FLOPs
    return {
        "decode_speedup_32_vs_sequential": record(
            "decode_speedup_32_vs_sequential", dec["decode_speedup_32_vs_sequential_runs"], median_run
        ),
        "decode_roofline_fraction_b32": record(
            "decode_roofline_fraction_b32", dec["decode_roofline_fraction_b32_runs"], roofline
        ),
    }


def _flatten(runs: list[list[RequestRecord]]) -> list[RequestRecord]:
    return [r for run in runs for r in run]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--cache-model", default=bench_cache.MODEL, help="the cache-reach figures' model")
    parser.add_argument("--duration", type=float, default=None, help="seconds per load run (20; --quick: 8)")
    parser.add_argument("--quick", action="store_true", help="every figure once, short loads; README left alone")
    parser.add_argument("--out", type=Path, default=None, help="summary.json (default: loadtest/results/[quick/])")
    args = parser.parse_args(argv)
    st = Settings(args.quick, args.duration)
    out = args.out or (QUICK if st.quick else RESULTS) / "summary.json"
    started = time.time()
    model, d = args.model, st.duration
    config = {
        "model": {"model": model, "torch_threads": 1},
        "deployments": {s: {"num_cpus": 0.25} for s in ("media", "encode", "prefill", "decode")},
        "server": {"api_keys": {servers.KEY: "bench", servers.ALPHA: "alpha", servers.BETA: "beta"}},
        "admission": {"tenants": {"alpha": {"max_media_in_flight": 2}}},
        "observability": {"trace_cache_hits": True},
    }
    metrics: dict[str, Any] = {}

    def say(msg: str) -> None:
        print(f"[bench {time.time() - started:5.0f}s] {msg}", file=sys.stderr, flush=True)

    say("decode engine")
    metrics.update(_decode(model, st))
    say("transfers (object store, NIXL, UCX's own READ), in a Ray session of their own")
    metrics.update(_transfers(st))

    n_ttft, n_hot = st.runs("ttft_ratio_epd_vs_monolith"), st.runs("encoder_cache_hot_cold_ttft_ratio")
    n_flood, n_tenant = st.runs("text_ttft_p95_flood_vs_idle"), st.runs("tenant_ttft_p95_flood_vs_idle")
    with servers.subprocess_server("loadtest.servers.naive", ["--model", model]) as url:
        say("naive: its capacity (a ramp of mixed loads), then the sweep around it")
        ramp = loads.ramp(url, model, d, st.min_requests)
        base = capacity(ramp) or RAMP[0]
        rates = sweep_rates(base)
        naive_sweep = loads.sweep(url, model, rates, d, st.min_requests)
    warm_up = loads.medium("cold", seed_of("warm_up"))  # first-request costs out of the figures
    cold, floods, betas = [], [], []
    with servers.prism_app(config) as url:
        loads.load(url, model, warm_up, 1.0, 4.0, seed=seed_of("warm_up"))
        # Prism's runs of different figures are interleaved (run i of each, then run i + 1), each with seeds — and so
        # images — of its own (bench_loads.SEEDS): a slow spell lands on one run of several figures rather than on
        # every run of one, and a cold cache stays cold. (The monolith runs after Prism, one server at a time: a
        # ratio's run i pairs the two servers' i-th runs, not two runs at the same moment.)
        for i in range(max(n_ttft, n_flood, n_tenant)):
            say(f"Prism, run {i + 1}: light load of medium images; text probes idle / under a flood")
            if i < n_ttft:
                s = seed_of("cold", i)
                cold.append(loads.load(url, model, loads.medium("cold", s), 0.5, d, seed=s))
            if i < n_flood:
                floods.append(loads.flood(url, model, d, seed_of("flood", i)))
            if i < n_tenant:
                say(f"Prism, run {i + 1}: tenant beta's text probes idle / under tenant alpha's large-image flood")
                keys = {"flood_key": servers.ALPHA, "probe_key": servers.BETA}
                betas.append(loads.flood(url, model, d, seed_of("tenant_flood", i), **keys))
        say(f"Prism: the goodput sweep at {rates} rps")
        prism_sweep = loads.sweep(url, model, rates, d, st.min_requests)
    cache_model = args.cache_model
    with servers.prism_app(bench_cache.app_config(config, cache_model)) as url:
        loads.load(url, cache_model, warm_up, 1.0, 4.0, seed=seed_of("warm_up"))
        cache_cold, cache_hot = bench_cache.measure(url, cache_model, n_hot, d, say)
    mono_cold, mono_floods = [], []
    with servers.subprocess_server("loadtest.servers.monolith", ["--config", servers.write_config(config)]) as url:
        loads.load(url, model, warm_up, 1.0, 4.0, seed=seed_of("warm_up"))
        for i in range(max(n_ttft, n_flood)):
            say(f"monolith, run {i + 1}: light load, medium images; text probes idle / flood")
            if i < n_ttft:
                s = seed_of("cold", i)
                mono_cold.append(loads.load(url, model, loads.medium("cold", s), 0.5, d, seed=s))
            if i < n_flood:
                mono_floods.append(loads.flood(url, model, d, seed_of("flood", i)))
        say(f"monolith: the goodput sweep at {rates} rps")
        mono_sweep = loads.sweep(url, model, rates, d, st.min_requests)

    metrics["ttft_ratio_epd_vs_monolith"] = record(
        "ttft_ratio_epd_vs_monolith",
        [loads.ratio(loads.ttft(p), loads.ttft(m)) for p, m in zip(cold, mono_cold, strict=True)],
        [
            {
                "prism_ttft_p50_s": loads.ttft(p),
                "monolith_ttft_p50_s": loads.ttft(m),
                "requests": len(p),
                "prism_stage_ms_mean": loads.stages(p),
                "monolith_stage_ms_mean": loads.stages(m),
            }
            for p, m in zip(cold, mono_cold, strict=True)
        ],
        sides={"prism": _flatten(cold), "monolith": _flatten(mono_cold)},
    )
    metrics.update(bench_cache.figures(cache_model, cache_cold, cache_hot))
    metrics["text_ttft_p95_flood_vs_idle"] = record(
        "text_ttft_p95_flood_vs_idle",
        [f.ratio for f in floods],
        [
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
            for f, m in zip(floods, mono_floods, strict=True)
        ],
        sides={
            "idle probes": _flatten([f.idle for f in floods]),
            "flood probes": _flatten([f.probes for f in floods]),
        },
    )
    metrics["tenant_ttft_p95_flood_vs_idle"] = record(
        "tenant_ttft_p95_flood_vs_idle",
        [b.ratio for b in betas],
        [
            {
                "beta_idle_p95_s": loads.ttft(b.idle, "p95"),
                "beta_flood_p95_s": loads.ttft(b.probes, "p95"),
                "alpha_flood_load": outcome_counts(b.flood),
                "alpha_quota": {"max_media_in_flight": 2},
            }
            for b in betas
        ],
        sides={
            "beta idle probes": _flatten([b.idle for b in betas]),
            "beta flood probes": _flatten([b.probes for b in betas]),
        },
    )
    # The naive server's knee (the first swept rate it cannot carry; the top rate if it carries them all) is where
    # the goodputs are compared. Both sides must be healthy at the lowest rate (errors there mean a broken server,
    # not an overloaded one: the figure is invalid); at the knee, errors and timeouts are part of the result.
    naive_points = [(r, naive_sweep[r][0]["slo_attainment"]) for r in rates]
    at = knee(naive_points) or rates[-1]
    prism_good, naive_good = prism_sweep[at][0]["goodput_rps"], naive_sweep[at][0]["goodput_rps"]
    sweeps = {
        name: [loads.sweep_row(r, runs[r]) for r in rates]
        for name, runs in (("prism", prism_sweep), ("monolith", mono_sweep), ("naive", naive_sweep))
    }
    metrics["goodput_ratio_vs_naive"] = record(
        "goodput_ratio_vs_naive",
        [loads.ratio(prism_good, naive_good)],
        {
            "compared_at_rps": at,
            "naive_capacity_rps": capacity(naive_points),
            "naive_ramp": [{"rate_rps": r, "slo_attainment": a} for r, a in ramp],
            "slo": prism_sweep[at][0]["slo"],
            "keep_up_slo_attainment": KEEP_UP,
            "sweep": sweeps,
        },
        sides={
            "prism at the lowest rate": prism_sweep[rates[0]][1],
            "naive at the lowest rate": naive_sweep[rates[0]][1],
        },
        goodput={"prism at the knee": prism_good, "naive at the knee": naive_good},
    )
    plots_dir = out.parent
    panels = {
        "light load, medium images (p50 figures)": {
            **{f"prism cold #{i + 1}": r for i, r in enumerate(cold)},
            **{f"monolith cold #{i + 1}": r for i, r in enumerate(mono_cold)},
        },
        f"cache reach, {cache_model} (p50 figure)": {
            **{f"cold #{i + 1}": r for i, r in enumerate(cache_cold)},
            **{f"hot, new questions #{i + 1}": r for i, r in enumerate(cache_hot)},
        },
        "text probes, one tenant (p95 figure)": {
            **{f"prism idle #{i + 1}": f.idle for i, f in enumerate(floods)},
            **{f"prism flood #{i + 1}": f.probes for i, f in enumerate(floods)},
            **{f"monolith flood #{i + 1}": m.probes for i, m in enumerate(mono_floods)},
        },
        "tenant beta's text probes (p95 figure)": {
            **{f"idle #{i + 1}": b.idle for i, b in enumerate(betas)},
            **{f"alpha flooding #{i + 1}": b.probes for i, b in enumerate(betas)},
        },
        **{
            f"goodput sweep: {name}": {f"{r:g} rps": runs[r][1] for r in rates}
            for name, runs in (("prism", prism_sweep), ("monolith", mono_sweep), ("naive", naive_sweep))
        },
    }
    plots = [
        bench_plots.goodput_vs_rate(plots_dir / bench_plots.GOODPUT_PNG, sweeps, at),
        bench_plots.ttft_cdfs(plots_dir / bench_plots.TTFT_PNG, panels),
    ]
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": model,
        "cache_model": cache_model,
        "quick": st.quick,
        "duration_s_per_run": d,
        "slo": {"goodput": prism_sweep[at][0]["slo"], "keep_up_slo_attainment": KEEP_UP},
        "wall_s": round(time.time() - started, 1),
        "plots": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in plots],
        "metrics": {f.name: metrics[f.name] for f in figures.FIGURES},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    if not st.quick:
        update_readme(summary)
    say("done")
    print(out)
    return out


def table(summary: dict[str, Any]) -> str:
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
        f"Measured {summary['date'][:10]} on {summary['machine']['cpus']} CPUs ({summary['machine']['platform']}), "
        f"model `{summary['model']}`, {summary['wall_s']:.0f} s wall; raw figures in `loadtest/results/summary.json`."
    )
    plots = ", ".join(
        f"[{Path(p).stem.removeprefix('bench_').replace('_', ' ')}]({p})" for p in summary.get("plots", [])
    )
    return head + "\n\n" + "\n".join(rows) + (f"\n\nPlots: {plots}." if plots else "")


START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def update_readme(summary: dict[str, Any], readme: Path = README) -> None:
    """Replace the block between the bench markers with the table of ``summary``."""
    text = readme.read_text(encoding="utf-8")
    block = f"{START}\n{table(summary)}\n{END}"
    readme.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S), "utf-8")


if __name__ == "__main__":
    main()
