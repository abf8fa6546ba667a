"""The fixed cost of each Serve hop, read from Prism's own traces: ``n`` requests sent one after another (nothing
else in flight, so nothing but the hop itself waits), text-only and with one small (224²) image, each image new
(cold caches: every stage runs). Per request kind, the p50 of every trace span, and of the spans that are a hop
rather than work — ``<stage>.queue`` (Serve's routing and the replica's queue until the stage starts),
``<stage>.transfer`` (the hand-off of the upstream's result, its bytes and backend in the span), ``decode.reserve``
(the ingress's KV reservation round trip) and ``first_token`` (the decode's first token back through the ingress to
the client's stream) — with their sum beside the client's TTFT p50. Text-only requests skip media and encode.

``python -m loadtest.bench_hops --url http://127.0.0.1:8000/v1 --model prism-tiny-llava`` prints the report as JSON;
``make bench`` runs it once in Prism's session (``per_hop_fixed_cost`` in the summary's raw numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx

from loadtest.client import send
from loadtest.stats import RequestRecord, percentile
from loadtest.workload import OutputLengths, Workload

HOP_SUFFIXES = (".queue", ".transfer", ".reserve")
HOP_NAMES = ("first_token",)
KINDS = {"text": {"text": 1.0}, "one_small_image": {"image": 1.0}}


def is_hop(name: str) -> bool:
    """A span that is the cost of crossing between deployments, not a stage's work."""
    return name in HOP_NAMES or name.endswith(HOP_SUFFIXES)


async def _sequential(url: str, model: str, workload: Workload, n: int, api_key: str | None) -> list[RequestRecord]:
    endpoint = url.rstrip("/") + "/chat/completions"
    records = []
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(n):
            kind, body = workload.next_request(model)  # (built between requests, outside every timing)
            records.append(await send(http, endpoint, body, kind, 0.0, api_key, trace=True))
    return records


def _p50(values: list[float]) -> float | None:
    found = percentile(values, 50)
    return None if found is None else round(found, 2)


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    """Per-span p50s (ms) of the ok, traced requests; the hops' p50s and the p50 of their per-request sum."""
    traced = [r for r in records if r.ok and r.trace]
    spans: dict[str, list[float]] = {}
    sums = []
    for r in traced:
        assert r.trace is not None
        total = 0.0
        for span in r.trace.get("spans", []):
            spans.setdefault(span["name"], []).append(float(span["duration_ms"]))
            total += float(span["duration_ms"]) if is_hop(span["name"]) else 0.0
        sums.append(total)
    p50s = {name: _p50(values) for name, values in spans.items()}
    return {
        "requests": len(records),
        "traced_ok": len(traced),
        "ttft_p50_ms": _p50([1000 * r.ttft_s for r in traced if r.ttft_s is not None]),
        "hops_p50_ms": {name: p for name, p in p50s.items() if is_hop(name)},
        "hops_total_p50_ms": _p50(sums),
        "spans_p50_ms": p50s,
    }


def hop_costs(url: str, model: str, n: int = 20, seed: int = 7, api_key: str | None = None) -> dict[str, Any]:
    """The report of both request kinds (a warm-up request of each first, left out)."""
    out: dict[str, Any] = {"n": n}
    for kind, mix in KINDS.items():
        workload = Workload(mix=mix, sizes={"small": 1}, cache="cold", outputs=OutputLengths("fixed:4"), seed=seed)
        asyncio.run(_sequential(url, model, workload, 1, api_key))
        out[kind] = summarize(asyncio.run(_sequential(url, model, workload, n, api_key)))
    return out


def table(reports: dict[str, dict[str, Any]]) -> str:
    """``{server: hop_costs(...)}`` as a Markdown table: one row per hop and request kind, one column per server."""
    servers = [name for name, report in reports.items() if report]
    if not servers:
        return ""
    rows = ["| Hop (p50 ms) | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers)]
    for kind in KINDS:
        names = dict.fromkeys(n for s in servers for n in reports[s][kind]["hops_p50_ms"])
        lines = [(n, [reports[s][kind]["hops_p50_ms"].get(n) for s in servers]) for n in names]
        lines += [("all hops", [reports[s][kind]["hops_total_p50_ms"] for s in servers])]
        lines += [("TTFT", [reports[s][kind]["ttft_p50_ms"] for s in servers])]
        for name, values in lines:
            cells = " | ".join("—" if v is None else f"{v:.1f}" for v in values)
            rows.append(f"| {kind}: `{name}` | {cells} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="prism-tiny-llava")
    parser.add_argument("-n", type=int, default=20, help="requests of each kind (default 20)")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(hop_costs(args.url, args.model, args.n, api_key=args.api_key), indent=1))


if __name__ == "__main__":
    main()
