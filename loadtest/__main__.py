"""``python -m loadtest``: an open-loop (or closed-loop) load run against any OpenAI-compatible endpoint.

Examples::

    python -m loadtest --url http://127.0.0.1:8000/v1 --rate 2 --duration 60
    python -m loadtest --url http://127.0.0.1:8000/v1 --rates 1,2,4 --process gamma --cv 2 \\
        --mix text=0.3,image=0.5,multi_image=0.2 --sizes small=0.5,medium=0.3,large=0.2 --cache partial \\
        --outputs uniform:16-64 --slo-ttft 1.5 --slo-itl 0.1 --out loadtest/results/mixed

Writes ``<out>/report.json`` and PNG plots; prints the summary path last.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import httpx

from loadtest.report import write_report
from loadtest.runner import RunSpec, run
from loadtest.stats import SLO, summarize
from loadtest.workload import BUCKETS, OutputLengths, Workload, parse_weights


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--url", required=True, help="base URL of the API, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model name (default: the first of GET /models)")
    p.add_argument("--api-key", help="Bearer key")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=2.0, help="open loop: requests/s (default 2)")
    load.add_argument("--rates", help="open loop sweep: comma-separated rates, one run each")
    load.add_argument("--concurrency", type=int, help="closed loop: N clients back to back instead of a rate")
    p.add_argument("--process", choices=("poisson", "gamma"), default="poisson", help="arrival process")
    p.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation (burstiness)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of sending per run")
    p.add_argument("--mix", default="text=0.5,image=0.5", help="kind weights: text, image, multi_image, video")
    p.add_argument("--sizes", default="small=0.5,medium=0.4,large=0.1", help=f"image buckets: {', '.join(BUCKETS)}")
    p.add_argument("--cache", choices=("cold", "hot", "partial"), default="cold", help="media reuse regime")
    p.add_argument("--reuse", type=float, default=0.5, help="partial: probability an image repeats")
    p.add_argument("--outputs", default="fixed:32", help="output lengths: fixed:N, uniform:A-B, exp:MEAN")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT seconds")
    p.add_argument("--slo-itl", type=float, default=0.2, help="goodput SLO: mean inter-token seconds")
    p.add_argument("--no-trace", action="store_true", help="do not ask for Prism traces (X-Prism-Trace)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest/results/run", help="output directory")
    return p


def _model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=30).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        mix = parse_weights(args.mix, ("text", "image", "multi_image", "video"))
        sizes = parse_weights(args.sizes, tuple(BUCKETS))
        OutputLengths(args.outputs).sample(random.Random(0))
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    model = args.model or _model(args.url, args.api_key)
    rates: list[float | None] = (
        [None] if args.concurrency else ([float(r) for r in args.rates.split(",")] if args.rates else [args.rate])
    )
    slo = SLO(ttft_s=args.slo_ttft, itl_s=args.slo_itl)
    runs = []
    for i, rate in enumerate(rates):
        workload = Workload(
            mix=mix,
            sizes=sizes,
            cache=args.cache,
            reuse=args.reuse,
            outputs=OutputLengths(args.outputs),
            seed=args.seed + i,
        )
        spec = RunSpec(
            url=args.url,
            model=model,
            duration_s=args.duration,
            rate=rate,
            process=args.process,
            cv=args.cv,
            concurrency=args.concurrency,
            api_key=args.api_key,
            trace=not args.no_trace,
            timeout_s=args.timeout,
            seed=args.seed + i,
        )
        label = f"{rate:g} rps" if rate is not None else f"{args.concurrency} clients"
        print(f"[loadtest] run {i + 1}/{len(rates)}: {label}, {args.duration:g}s, {args.process}", file=sys.stderr)
        records, duration = asyncio.run(run(spec, workload))
        runs.append(
            {"label": label, "offered_rps": rate, "summary": summarize(records, duration, slo), "records": records}
        )
    paths = write_report(Path(args.out), runs)
    for r in runs:
        s = r["summary"]
        print(
            f"[loadtest] {r['label']}: ok {s['ok']}/{s['requests']}, TTFT p50 {_ms(s['ttft_s']['p50'])} "
            f"p95 {_ms(s['ttft_s']['p95'])}, goodput {s['goodput_rps']:.2f} rps",
            file=sys.stderr,
        )
    print(paths[0])
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
