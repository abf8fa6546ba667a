"""``make bench``: Prism against a monolith and a naive transformers server, side by side in one run.

Everything runs on this machine, one server at a time (so they never share the cores), with the same model
(``prism-small-llava`` unless ``--model``), the same workloads and seeds. Writes ``loadtest/results/summary.json``
(each figure with the raw numbers it came from and its target) and the README table, and prints the path last.

Figures:

* ``ttft_ratio_epd_vs_monolith`` — p50 TTFT, one medium image per request, light open-loop load; Prism / monolith.
* ``handoff_bw_fraction_of_memcpy`` — a KV payload through the object store between two processes, from publish to
  the receiver's own buffers, / one warm memcpy; the lower of 64 MB and 256 MB (:mod:`loadtest.bench_transfer`; two
  copies: at most 0.5).
* ``nixl_bw_fraction_of_memcpy`` — the same over NIXL (UCX, DRAM to DRAM).
* ``decode_speedup_32_vs_sequential``, ``decode_roofline_fraction_b32`` — from :mod:`loadtest.bench_decode`.
* ``encoder_cache_hot_cold_ttft_ratio`` — p50 TTFT with one repeated image / with unique images (Prism).
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

from loadtest import bench_loads as loads
from loadtest import bench_servers as servers
from loadtest.stats import RequestRecord, outcome_counts
from loadtest.sweep import KEEP_UP, RAMP, capacity, knee, sweep_rates
from loadtest.verdict import judge

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
README = ROOT / "README.md"
TARGETS = {
    "ttft_ratio_epd_vs_monolith": ("<=", 1.10),
    "handoff_bw_fraction_of_memcpy": (">=", 0.4),
    "nixl_bw_fraction_of_memcpy": (">=", 0.25),
    "decode_speedup_32_vs_sequential": (">=", 10.0),
    "decode_roofline_fraction_b32": (">=", 0.5),
    "encoder_cache_hot_cold_ttft_ratio": ("<=", 0.3),
    "text_ttft_p95_flood_vs_idle": ("<=", 1.5),
    "tenant_ttft_p95_flood_vs_idle": ("<=", 3.0),
    "goodput_ratio_vs_naive": (">=", 3.0),
}
OWN_TARGETS = {"nixl_bw_fraction_of_memcpy", "decode_roofline_fraction_b32"}
"""Yardsticks of ours; the others are the targets issue 8 set."""


def _transfers() -> dict[str, Any]:
    import ray

    from loadtest import bench_transfer

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:  # its own session: the NIXL agents' UCX threads must not linger beside the servers measured later
        store = bench_transfer.transport_figures("object_store")
        nx = bench_transfer.transport_figures("nixl")
    finally:
        ray.shutdown()
    note = "publish + fetch + copy into the receiver's pre-touched buffers; two copies: at most 0.5 (two_copy_floor)"
    return {
        "handoff_bw_fraction_of_memcpy": _metric(
            "handoff_bw_fraction_of_memcpy", store["fraction_of_memcpy"], store, note=note
        ),
        "nixl_bw_fraction_of_memcpy": _metric("nixl_bw_fraction_of_memcpy", nx["fraction_of_memcpy"], nx, note=note),
    }


def _metric(
    name: str,
    value: float | None,
    raw: dict[str, Any],
    note: str = "",
    sides: dict[str, list[RequestRecord]] | None = None,
    goodput: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One figure: its value, target and status (:func:`loadtest.verdict.judge`), with each side's outcome counts."""
    op, target = TARGETS[name]
    counts = {side: outcome_counts(records) for side, records in (sides or {}).items()}
    status, reason = judge(value, op, target, counts, goodput)
    out: dict[str, Any] = {"value": value, "target": f"{op} {target:g}", "met": status == "met", "status": status}
    if reason:
        out["invalid_reason"] = reason
    if counts:
        out["sides"] = counts
    return {**out, "raw": raw, **({"note": note} if note else {})}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per load run")
    parser.add_argument("--out", type=Path, default=RESULTS / "summary.json")
    args = parser.parse_args(argv)
    started = time.time()
    model, d = args.model, args.duration
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
    from loadtest import bench_decode

    dec = bench_decode.main(["--model", model, "--out", str(RESULTS / "decode.json")])
    metrics["decode_speedup_32_vs_sequential"] = _metric(
        "decode_speedup_32_vs_sequential",
        dec["decode_speedup_32_vs_sequential"],
        {
            "timed": "end to end on both sides: from the prefill output handed over (KV import included)",
            "engine_b32_e2e_tokens_per_s": dec["engine"]["32"]["e2e_tokens_per_s"],
            "sequential_e2e_tokens_per_s": dec["sequential"]["e2e_tokens_per_s"],
            "speedup_after_kv_import": dec["decode_speedup_32_vs_sequential_steps"],
            "engine_b32_tokens_per_s": dec["engine"]["32"]["tokens_per_s"],
            "sequential_tokens_per_s": dec["sequential"]["tokens_per_s"],
        },
    )
    metrics["decode_roofline_fraction_b32"] = _metric(
        "decode_roofline_fraction_b32",
        dec["decode_roofline_fraction_b32"],
        {"achieved_bytes_per_s": dec["engine"]["32"]["bytes_per_s"], "memcpy_bytes_per_s": dec["memcpy_bytes_per_s"]},
    )

    say("transfers (object store, NIXL), in a Ray session of their own")
    metrics.update(_transfers())
    with servers.subprocess_server("loadtest.servers.naive", ["--model", model]) as url:
        say("naive: its capacity (a ramp of mixed loads), then the sweep around it")
        ramp = loads.ramp(url, model, d)
        base = capacity(ramp) or RAMP[0]
        rates = sweep_rates(base)
        naive_sweep = loads.sweep(url, model, rates, d)
    with servers.prism_app(config) as url:
        say("Prism: light load, medium images (cold, then hot)")
        loads.load(
            url, model, loads.medium("cold", 99), 1.0, 4.0, seed=99
        )  # warm-up: first-request costs out of the figures
        cold = loads.load(url, model, loads.medium("cold", 1), 0.5, d, seed=1)
        hot = loads.load(url, model, loads.medium("hot", 2), 0.5, d, seed=2)
        say("Prism: text probes idle / under a large-image flood")
        prism_flood = loads.flood(url, model, d)
        say("Prism: tenant beta's text probes idle / under tenant alpha's large-image flood")
        beta = loads.flood(url, model, d, flood_key=servers.ALPHA, probe_key=servers.BETA)
        say(f"Prism: the goodput sweep at {rates} rps")
        prism_sweep = loads.sweep(url, model, rates, d)
    with servers.subprocess_server("loadtest.servers.monolith", ["--config", servers.write_config(config)]) as url:
        say("monolith: light load, medium images; text probes idle / flood")
        loads.load(url, model, loads.medium("cold", 99), 1.0, 4.0, seed=99)
        mono_cold = loads.load(url, model, loads.medium("cold", 1), 0.5, d, seed=1)
        mono_flood = loads.flood(url, model, d)
        say(f"monolith: the goodput sweep at {rates} rps")
        mono_sweep = loads.sweep(url, model, rates, d)

    metrics["ttft_ratio_epd_vs_monolith"] = _metric(
        "ttft_ratio_epd_vs_monolith",
        loads.ratio(loads.ttft(cold), loads.ttft(mono_cold)),
        {
            "prism_ttft_p50_s": loads.ttft(cold),
            "monolith_ttft_p50_s": loads.ttft(mono_cold),
            "requests": len(cold),
            "prism_stage_ms_mean": loads.stages(cold),
            "monolith_stage_ms_mean": loads.stages(mono_cold),
        },
        sides={"prism": cold, "monolith": mono_cold},
    )
    metrics["encoder_cache_hot_cold_ttft_ratio"] = _metric(
        "encoder_cache_hot_cold_ttft_ratio",
        loads.ratio(loads.ttft(hot), loads.ttft(cold)),
        {
            "hot_ttft_p50_s": loads.ttft(hot),
            "cold_ttft_p50_s": loads.ttft(cold),
            "hot_stage_ms_mean": loads.stages(hot),
            "cold_stage_ms_mean": loads.stages(cold),
        },
        note="hot repeats one image: the processor, encoder and prefix caches all hit",
        sides={"hot": hot, "cold": cold},
    )
    metrics["text_ttft_p95_flood_vs_idle"] = _metric(
        "text_ttft_p95_flood_vs_idle",
        prism_flood.ratio,
        {
            "prism_idle_p95_s": loads.ttft(prism_flood.idle, "p95"),
            "prism_flood_p95_s": loads.ttft(prism_flood.probes, "p95"),
            "prism_flood_load": outcome_counts(prism_flood.flood),  # its 429s are admission at work, not errors
            "monolith_ratio": mono_flood.ratio,
            "monolith_idle_p95_s": loads.ttft(mono_flood.idle, "p95"),
            "monolith_flood_p95_s": loads.ttft(mono_flood.probes, "p95"),
            "monolith_probes": outcome_counts(mono_flood.probes),
            "monolith_flood_load": outcome_counts(mono_flood.flood),
        },
        sides={"idle probes": prism_flood.idle, "flood probes": prism_flood.probes},
    )
    metrics["tenant_ttft_p95_flood_vs_idle"] = _metric(
        "tenant_ttft_p95_flood_vs_idle",
        beta.ratio,
        {
            "beta_idle_p95_s": loads.ttft(beta.idle, "p95"),
            "beta_flood_p95_s": loads.ttft(beta.probes, "p95"),
            "alpha_flood_load": outcome_counts(beta.flood),
            "alpha_quota": {"max_media_in_flight": 2},
        },
        sides={"beta idle probes": beta.idle, "beta flood probes": beta.probes},
    )
    # The naive server's knee (the first swept rate it cannot carry; the top rate if it carries them all) is where
    # the goodputs are compared. Both sides must be healthy at the lowest rate (errors there mean a broken server,
    # not an overloaded one: the figure is invalid); at the knee, errors and timeouts are part of the result.
    naive_points = [(r, naive_sweep[r][0]["slo_attainment"]) for r in rates]
    at = knee(naive_points) or rates[-1]
    prism_good, naive_good = prism_sweep[at][0]["goodput_rps"], naive_sweep[at][0]["goodput_rps"]
    metrics["goodput_ratio_vs_naive"] = _metric(
        "goodput_ratio_vs_naive",
        loads.ratio(prism_good, naive_good),
        {
            "compared_at_rps": at,
            "naive_capacity_rps": capacity(naive_points),
            "naive_ramp": [{"rate_rps": r, "slo_attainment": a} for r, a in ramp],
            "slo": prism_sweep[at][0]["slo"],
            "keep_up_slo_attainment": KEEP_UP,
            "sweep": {
                name: [loads.sweep_row(r, runs[r]) for r in rates]
                for name, runs in (("prism", prism_sweep), ("monolith", mono_sweep), ("naive", naive_sweep))
            },
        },
        sides={
            "prism at the lowest rate": prism_sweep[rates[0]][1],
            "naive at the lowest rate": naive_sweep[rates[0]][1],
        },
        goodput={"prism at the knee": prism_good, "naive at the knee": naive_good},
    )
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": model,
        "duration_s_per_run": d,
        "wall_s": round(time.time() - started, 1),
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    update_readme(summary)
    say("done")
    print(args.out)
    return args.out


def table(summary: dict[str, Any]) -> str:
    rows = ["| Figure | Value | Target | Met |", "|---|---|---|---|"]
    for name, m in summary["metrics"].items():
        target = m["target"] + (" (ours)" if name in OWN_TARGETS else "")
        value = "—" if m["value"] is None else f"{m['value']:.3g}"
        status = m.get("status", "met" if m["met"] else "missed")  # (summaries written before the status field)
        met = {"met": "yes", "missed": "no"}.get(status, f"invalid: {m.get('invalid_reason', '')}")
        rows.append(f"| `{name}` | {value} | {target} | {met} |")
    head = (
        f"Measured {summary['date'][:10]} on {summary['machine']['cpus']} CPUs ({summary['machine']['platform']}), "
        f"model `{summary['model']}`, {summary['wall_s']:.0f} s wall; raw figures in `loadtest/results/summary.json`."
    )
    return head + "\n\n" + "\n".join(rows)


START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def update_readme(summary: dict[str, Any], readme: Path = README) -> None:
    """Replace the block between the bench markers with the table of ``summary``."""
    text = readme.read_text(encoding="utf-8")
    block = f"{START}\n{table(summary)}\n{END}"
    readme.write_text(re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S), "utf-8")


if __name__ == "__main__":
    main()
