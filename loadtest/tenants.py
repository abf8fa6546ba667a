"""One tenant's text while others flood large images, with no quota set: ``python -m loadtest.tenants``.

Not part of ``make test`` (minutes, and it saturates the machine). It starts a local Ray cluster of its own, as
``make serve`` does (the proxy guard and Prism's worker niceness in the environment of its raylet), and the
application of ``make serve``'s config (``ray_configs/local_cpu.yaml``) with API keys for tenants ``alpha``,
``beta`` (and ``gamma``) and no quota — what a new user gets. Then:

1. ``beta`` sends short streamed text requests one after another (``--probes``, ``--gap`` apart), idle;
2. ``alpha`` (and with ``--flooders 2`` also ``gamma``) floods: ``--clients`` closed-loop clients each, every request
   one 1920×1440 JPEG (distinct images, encoded before the load starts) — or, with ``--flood schemas``, a text request
   under a JSON schema of ~50 KB (300 enum properties) that no earlier request used, so every stage compiles it anew —
   honouring ``Retry-After`` on a 429;
3. after a few seconds of flood, ``beta`` probes again.

It prints, as JSON, beta's time to the first content chunk measured at the client (p50 / p95, idle and under the
flood, and the p95 ratio: issue 34 asks ≤ 3) and what each flooder got (responses by status, answered requests per
second) — the figure that the bench's ``tenant_ttft_p95_flood_vs_idle`` measures under a lighter, open-loop flood.
With ``--alone S``, the flood's steady rate is also measured over ``S`` seconds with beta idle (before its
probes; issue 34 asks that fairness leave a lone flooder at least 90 % of its goodput), and beside beta's probes.
With ``--trace``, beta's requests ask for Prism's trace, and the output says where their time went, idle and under
the flood: the client's wait outside the trace (the proxy, the queue for an ingress replica, the way back) and each
span's duration (p50 / p95).

    python -m loadtest.tenants [--clients 48] [--flooders 1] [--probes 40] [--flood images|schemas] [--trace]
                               [--alone S]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from common.media.synthetic import synthetic_image

ROOT = Path(__file__).resolve().parents[1]
MODEL = "prism-tiny-llava"
PROBE_KEY, FLOOD_KEYS = "key-beta", ("key-alpha", "key-gamma")
KEYS = {"key-alpha": "alpha", "key-beta": "beta", "key-gamma": "gamma"}


def app_config(path: Path = ROOT / "ray_configs" / "local_cpu.yaml") -> dict[str, Any]:
    """``make serve``'s application config with the three tenants' keys (and nothing else changed)."""
    app = yaml.safe_load(path.read_text())["applications"][0]
    cfg = dict(app["args"]["config"])
    cfg["server"] = {**cfg.get("server", {}), "api_keys": KEYS}
    return cfg


def jpeg_url(seed: int, size: tuple[int, int] = (1920, 1440)) -> str:
    buf = io.BytesIO()
    synthetic_image(*size, seed=seed).save(buf, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(http: httpx.Client, url: str, n: int, traces: list | None = None) -> float | None:
    """Seconds to the first content chunk of one short streamed text request of ``beta`` (``None``: not a 200). With
    ``traces``, the request asks for Prism's trace and appends it (read from the stream's end) there."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say something about {n}."}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {PROBE_KEY}", **({"X-Prism-Trace": "1"} if traces is not None else {})}
    start, first = time.perf_counter(), None
    with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return None
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
                if traces is None:
                    return first
            elif traces is not None and '"prism_trace"' in line:
                traces.append(json.loads(line[5:])["prism_trace"] | {"client_ttft_ms": first and first * 1000})
    return first


def _probes(url: str, n: int, gap: float, traces: list | None) -> tuple[list[float | None], list | None]:
    with httpx.Client(timeout=120) as http:
        out = []
        for i in range(n):
            out.append(ttft(http, url, i, traces))
            time.sleep(gap)
        return out, traces


def probes(url: str, n: int, gap: float, traces: list | None = None) -> list[float | None]:
    """``beta``'s requests, from a process of its own: a client of its own, as in the scenario — in the flooders'
    process its clock would also count the time it waits for their interpreter lock (48 threads). ``traces``: filled
    with each answered request's Prism trace."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out, got = pool.apply(_probes, (url, n, gap, [] if traces is not None else None))
    if traces is not None:
        traces.extend(got)
    return out


def where_time_went(traces: list[dict]) -> dict[str, Any]:
    """From beta's traces: the client's wait outside the trace (client TTFT − the trace's ``ttft_ms``: the proxy, the
    queue for an ingress replica, the way back) and each span's duration, p50 / p95 in ms."""

    def q(values: list[float]) -> dict[str, float] | None:
        return {k: v for k, v in quantiles_ms([v / 1000 for v in values]).items() if k != "failed"} if values else None

    spans: dict[str, list[float]] = {}
    for t in traces:
        for span in t.get("spans", []):
            spans.setdefault(span["name"], []).append(span["duration_ms"])
    outside = [t["client_ttft_ms"] - t["ttft_ms"] for t in traces if t.get("client_ttft_ms") and t.get("ttft_ms")]
    return {"outside_trace": q(outside), "trace_ttft": q([t["ttft_ms"] for t in traces if t.get("ttft_ms")])} | {
        name: q(values) for name, values in sorted(spans.items())
    }


def quantiles_ms(samples: list[float | None]) -> dict[str, Any]:
    """p50 / p95 in ms of the answered samples, and how many were not answered."""
    done = [s for s in samples if s is not None]
    failed = len(samples) - len(done)
    if len(done) < 2:  # (every probe refused or failed: nothing to take quantiles of)
        return {"p50_ms": None, "p95_ms": None, "failed": failed}
    cuts = statistics.quantiles(done, n=20, method="inclusive")
    return {"p50_ms": round(cuts[9] * 1000, 1), "p95_ms": round(cuts[18] * 1000, 1), "failed": failed}


def schema(n: int) -> dict[str, Any]:
    """A JSON schema of ~50 KB whose property names are the ``n``-th request's own (a grammar no cache holds)."""
    props = {f"k{n}_{i}": {"type": "string", "enum": [f"v{j}" for j in range(20)]} for i in range(300)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def flood_body(images: list[str], n: int) -> dict[str, Any]:
    """The ``n``-th flood request: an image (``images`` given) or a text request under a schema of its own."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    if not images:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{n}", "schema": schema(n)}}
        return body | {"messages": [{"role": "user", "content": "Fill the form."}], "response_format": fmt}
    content = [{"type": "image_url", "image_url": {"url": images[n % len(images)]}}]
    return body | {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "Describe it."}]}]}


def flooder(url: str, key: str, images: list[str], index: int, step: int, stop: threading.Event, out: list) -> None:
    n = index
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            body = flood_body(images, n)
            try:
                r = http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
                out.append(r.status_code)
                if r.status_code == 429:
                    time.sleep(float(r.headers.get("retry-after", "1")))
            except httpx.HTTPError:
                out.append("error")
            n += step


def run(
    url: str,
    clients: int,
    flooders: int,
    n_probes: int,
    gap: float,
    warm: float,
    flood: str = "images",
    trace: bool = False,
    alone: float = 0.0,
) -> dict[str, Any]:
    # (images encoded before any load: encoding them takes the cores)
    images = [jpeg_url(seed) for seed in range(64)] if flood == "images" else []
    probes(url, 3, gap)
    traced: dict[str, list] | None = {"idle": [], "flood": []} if trace else None
    idle = quantiles_ms(probes(url, n_probes, gap, traced and traced["idle"]))
    stop, got = threading.Event(), {KEYS[k]: [] for k in FLOOD_KEYS[:flooders]}
    threads = [
        threading.Thread(target=flooder, args=(url, key, images, i, clients, stop, got[KEYS[key]]), daemon=True)
        for key in FLOOD_KEYS[:flooders]
        for i in range(clients)
    ]
    start = time.time()
    for t in threads:
        t.start()
    time.sleep(warm)

    def answered() -> int:
        return sum(codes.count(200) for codes in got.values())

    rates = {}
    if alone > 0:  # the flood's steady rate with beta idle
        before, t0 = answered(), time.time()
        time.sleep(alone)
        rates["flood_alone_answered_per_s"] = round((answered() - before) / (time.time() - t0), 2)
    before, t0 = answered(), time.time()
    flooded = quantiles_ms(probes(url, n_probes, gap, traced and traced["flood"]))
    rates["flood_beside_beta_answered_per_s"] = round((answered() - before) / (time.time() - t0), 2)
    stop.set()
    for t in threads:
        t.join(120)
    seconds = time.time() - start
    where = {f"beta_trace_{k}": where_time_went(v) for k, v in traced.items()} if traced else {}
    return (
        where
        | rates
        | {
            "beta_idle": idle,
            "beta_under_flood": flooded,
            "p95_ratio": round(flooded["p95_ms"] / idle["p95_ms"], 2) if flooded["p95_ms"] and idle["p95_ms"] else None,
            "flooders": {
                tenant: {
                    "by_status": {str(s): codes.count(s) for s in sorted(set(codes), key=str)},
                    "answered_per_s": round(codes.count(200) / seconds, 2),
                }
                for tenant, codes in got.items()
            },
            "config": {
                "flood": flood,
                "clients_per_flooder": clients,
                "flooders": flooders,
                "probes": n_probes,
                "seconds": round(seconds),
            },
        }
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.tenants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=48, help="closed-loop clients per flooding tenant")
    parser.add_argument("--flooders", type=int, default=1, choices=[1, 2], help="flooding tenants (alpha, gamma)")
    parser.add_argument("--probes", type=int, default=40, help="beta's text requests, idle and under the flood")
    parser.add_argument("--gap", type=float, default=0.25, help="seconds between beta's requests")
    parser.add_argument("--warm", type=float, default=5.0, help="seconds of flood before beta probes")
    parser.add_argument("--flood", default="images", choices=["images", "schemas"], help="what the flooders send")
    parser.add_argument("--trace", action="store_true", help="beta asks for traces: where its time went, per span")
    parser.add_argument("--alone", type=float, default=0.0, help="seconds of flood measured with beta idle first")
    args = parser.parse_args(argv)

    from common.config import PrismConfig
    from loadtest.bench_servers import prism_app
    from services.platform.proxy_guard import GuardSettings, ray_env

    cfg = app_config()
    os.environ.update(ray_env(GuardSettings.of([("prism", "/", PrismConfig.model_validate(cfg))])))  # (the guard too)
    with prism_app(cfg, key=PROBE_KEY) as url:
        result = run(
            f"{url}/chat/completions",
            args.clients,
            args.flooders,
            args.probes,
            args.gap,
            args.warm,
            args.flood,
            args.trace,
            args.alone,
        )
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
