"""``make bench``: Prism against a monolith and a naive transformers server, side by side in one run.

Everything runs on this machine, one server at a time (so they never share the cores), with the same model
(``prism-small-llava`` unless ``--model``), the same workloads and seeds. Writes ``loadtest/results/summary.json``
(each figure with the raw numbers it came from and its target) and the README table, and prints the path last.

Figures:

* ``ttft_ratio_epd_vs_monolith`` — p50 TTFT, one medium image per request, light open-loop load; Prism / monolith.
* ``handoff_bw_fraction_of_memcpy`` — 64 MB through the object store between two processes / memcpy.
* ``nixl_bw_fraction_of_memcpy`` — 256 MB over NIXL (UCX, DRAM) between two processes / memcpy.
* ``decode_speedup_32_vs_sequential``, ``decode_roofline_fraction_b32`` — from :mod:`loadtest.bench_decode`.
* ``encoder_cache_hot_cold_ttft_ratio`` — p50 TTFT with one repeated image / with unique images (Prism).
* ``text_ttft_p95_flood_vs_idle`` — p95 TTFT of text-only probes while large images flood / idle (Prism; the
  monolith's figure beside it). One tenant floods and probes: quotas cannot help, the stage budgets and the
  prefill lane must.
* ``tenant_ttft_p95_flood_vs_idle`` — the same with two tenants: ``alpha`` (at most 2 requests with media in
  flight) floods, ``beta`` probes; Prism only.
* ``goodput_ratio_vs_naive`` — goodput (requests meeting the TTFT and ITL SLOs per second) under the same mixed
  open-loop load; Prism / naive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.runner import RunSpec, plan, run
from loadtest.stats import SLO, RequestRecord, summarize
from loadtest.workload import OutputLengths, Workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
README = ROOT / "README.md"
TARGETS = {
    "ttft_ratio_epd_vs_monolith": ("<=", 1.10),
    "handoff_bw_fraction_of_memcpy": (">=", 0.5),
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
SLO_MIXED = SLO(ttft_s=2.0, itl_s=0.2)
KEY, ALPHA, BETA = "bench-key", "bench-alpha", "bench-beta"
"""API keys of the Prism runs: tenant ``bench`` for the single-tenant figures, ``alpha`` / ``beta`` for the
tenant figure (the monolith and the naive server ignore keys)."""


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            auth = {"Authorization": f"Bearer {KEY}"}  # (Prism's bench config has keys; the others ignore it)
            if httpx.get(f"{base}/v1/models", headers=auth, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} did not come up")


@contextmanager
def _subprocess_server(module: str, args: list[str]):
    port = _port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@contextmanager
def _prism(config: dict[str, Any]):
    import ray
    from ray import serve

    from services.app import build_app

    port = _port()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"config": config}), name="prism", route_prefix="/")
        _wait_ready(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def _load(
    url: str, model: str, workload: Workload, rate: float, duration: float, seed: int, key: str = KEY
) -> list[RequestRecord]:
    spec = RunSpec(url=url, model=model, duration_s=duration, rate=rate, seed=seed, trace=True, api_key=key)
    records, _ = asyncio.run(run(spec, workload, progress=None))
    return records


def _ttft(records: list[RequestRecord], p: str = "p50") -> float:
    return summarize(records, 1.0, SLO())["ttft_s"][p]


def _medium(cache: str, seed: int) -> Workload:
    return Workload(mix={"image": 1}, sizes={"medium": 1}, cache=cache, outputs=OutputLengths("fixed:16"), seed=seed)


def _flood(url: str, model: str, duration: float, flood_key: str = KEY, probe_key: str = KEY) -> tuple[float, float]:
    """(idle p95, flood p95) TTFT of text-only probes; the flood is large images at a steady rate."""
    probe = Workload(mix={"text": 1}, outputs=OutputLengths("fixed:8"), seed=11)
    idle = _load(url, model, probe, 1.0, duration, seed=11, key=probe_key)

    probe_spec = RunSpec(url=url, model=model, duration_s=duration, rate=1.0, seed=12, api_key=probe_key)
    flood_spec = RunSpec(url=url, model=model, duration_s=duration, rate=1.5, seed=13, trace=False, api_key=flood_key)
    flood = Workload(mix={"image": 0.5, "multi_image": 0.5}, sizes={"large": 1}, outputs=OutputLengths("fixed:8"))
    probes = Workload(mix={"text": 1}, outputs=OutputLengths("fixed:8"), seed=12)
    # Both plans are built before either load starts: encoding the flood's large JPEGs (~1 s of CPU per request)
    # inside the running loop stalled the probes' own sends and timings and took the cores from the server.
    probe_plan, flood_plan = plan(probe_spec, probes), plan(flood_spec, flood)

    async def both():
        (records, _), _ = await asyncio.gather(
            run(probe_spec, probes, None, probe_plan), run(flood_spec, flood, None, flood_plan)
        )
        return records

    flooded = asyncio.run(both())
    return _ttft(idle, "p95"), _ttft(flooded, "p95")


def _mixed(url: str, model: str, rate: float, duration: float) -> dict[str, Any]:
    workload = Workload(
        mix={"text": 0.4, "image": 0.4, "multi_image": 0.2},
        cache="partial",
        outputs=OutputLengths("uniform:8-32"),
        seed=21,
    )
    spec = RunSpec(
        url=url, model=model, duration_s=duration, rate=rate, seed=21, trace=False, timeout_s=60, api_key=KEY
    )
    records, seconds = asyncio.run(run(spec, workload, progress=None))
    return summarize(records, seconds, SLO_MIXED)


def _transfers() -> dict[str, Any]:
    import ray

    from loadtest import bench_transfer

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:  # its own session: the NIXL agents' UCX threads must not linger beside the servers measured later
        store, nx = bench_transfer.object_store(), bench_transfer.nixl()
    finally:
        ray.shutdown()
    return {
        "handoff_bw_fraction_of_memcpy": _metric("handoff_bw_fraction_of_memcpy", store["fraction_of_memcpy"], store),
        "nixl_bw_fraction_of_memcpy": _metric("nixl_bw_fraction_of_memcpy", nx["fraction_of_memcpy"], nx),
    }


def _stages(records: list[RequestRecord]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in summarize(records, 1.0, SLO())["stage_ms_mean"].items()}


def _metric(name: str, value: float, raw: dict[str, Any], note: str = "") -> dict[str, Any]:
    op, target = TARGETS[name]
    met = value <= target if op == "<=" else value >= target
    return {"value": value, "target": f"{op} {target:g}", "met": met, "raw": raw, **({"note": note} if note else {})}


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
        "server": {"api_keys": {KEY: "bench", ALPHA: "alpha", BETA: "beta"}},
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
    with _prism(config) as url:
        say("Prism: light load, medium images (cold, then hot)")
        _load(url, model, _medium("cold", 99), 1.0, 4.0, seed=99)  # warm-up: first-request costs out of the figures
        cold = _load(url, model, _medium("cold", 1), 0.5, d, seed=1)
        hot = _load(url, model, _medium("hot", 2), 0.5, d, seed=2)
        say("Prism: text probes idle / under a large-image flood")
        prism_idle, prism_flood = _flood(url, model, d)
        say("Prism: tenant beta's text probes idle / under tenant alpha's large-image flood")
        beta_idle, beta_flood = _flood(url, model, d, flood_key=ALPHA, probe_key=BETA)
        say("Prism: mixed load")
        prism_mixed = _mixed(url, model, 2.0, d * 1.5)
    with _subprocess_server("loadtest.servers.monolith", ["--config", _write_config(config)]) as url:
        say("monolith: light load, medium images; text probes idle / flood")
        _load(url, model, _medium("cold", 99), 1.0, 4.0, seed=99)
        mono_cold = _load(url, model, _medium("cold", 1), 0.5, d, seed=1)
        mono_idle, mono_flood = _flood(url, model, d)
    with _subprocess_server("loadtest.servers.naive", ["--model", model]) as url:
        say("naive: mixed load")
        naive_mixed = _mixed(url, model, 2.0, d * 1.5)

    metrics["ttft_ratio_epd_vs_monolith"] = _metric(
        "ttft_ratio_epd_vs_monolith",
        _ttft(cold) / _ttft(mono_cold),
        {
            "prism_ttft_p50_s": _ttft(cold),
            "monolith_ttft_p50_s": _ttft(mono_cold),
            "requests": len(cold),
            "prism_stage_ms_mean": _stages(cold),
            "monolith_stage_ms_mean": _stages(mono_cold),
        },
    )
    metrics["encoder_cache_hot_cold_ttft_ratio"] = _metric(
        "encoder_cache_hot_cold_ttft_ratio",
        _ttft(hot) / _ttft(cold),
        {
            "hot_ttft_p50_s": _ttft(hot),
            "cold_ttft_p50_s": _ttft(cold),
            "hot_stage_ms_mean": _stages(hot),
            "cold_stage_ms_mean": _stages(cold),
        },
        note="hot repeats one image: the processor, encoder and prefix caches all hit",
    )
    metrics["text_ttft_p95_flood_vs_idle"] = _metric(
        "text_ttft_p95_flood_vs_idle",
        prism_flood / prism_idle,
        {
            "prism_idle_p95_s": prism_idle,
            "prism_flood_p95_s": prism_flood,
            "monolith_ratio": mono_flood / mono_idle,
            "monolith_idle_p95_s": mono_idle,
            "monolith_flood_p95_s": mono_flood,
        },
    )
    metrics["tenant_ttft_p95_flood_vs_idle"] = _metric(
        "tenant_ttft_p95_flood_vs_idle",
        beta_flood / beta_idle,
        {"beta_idle_p95_s": beta_idle, "beta_flood_p95_s": beta_flood, "alpha_quota": {"max_media_in_flight": 2}},
    )
    prism_good, naive_good = prism_mixed["goodput_rps"], naive_mixed["goodput_rps"]
    metrics["goodput_ratio_vs_naive"] = _metric(
        "goodput_ratio_vs_naive",
        prism_good / naive_good if naive_good else float("inf"),
        {
            "rate_rps": 2.0,
            "slo": prism_mixed["slo"],
            "prism_goodput_rps": prism_good,
            "naive_goodput_rps": naive_good,
            "prism_ttft_p95_s": prism_mixed["ttft_s"]["p95"],
            "naive_ttft_p95_s": naive_mixed["ttft_s"]["p95"],
        },
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


def _write_config(config: dict[str, Any]) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(config, f)
    f.close()
    return f.name


def table(summary: dict[str, Any]) -> str:
    rows = ["| Figure | Value | Target | Met |", "|---|---|---|---|"]
    for name, m in summary["metrics"].items():
        target = m["target"] + (" (ours)" if name in OWN_TARGETS else "")
        rows.append(f"| `{name}` | {m['value']:.3g} | {target} | {'yes' if m['met'] else 'no'} |")
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
