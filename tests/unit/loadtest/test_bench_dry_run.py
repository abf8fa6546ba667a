"""``make bench``'s whole orchestration on fake servers: every session, sweep and figure, in the bench's own order.

The real bench takes over half an hour; a mistake in how its sessions hand runs to each other (a sweep's extra rate,
the flood figures' shared idle side, a figure's raw) would otherwise show only at its end. Here each server is a fake
of a given capacity — the naive one 3.5 rps, Prism's topologies 6.5, the monolith 7.5 — whose loads return records
in the blink of an eye, and the in-process figures (decode engine, grammar, transfers) are stand-ins; the sessions,
the sweep's climb, the serving figures, the plots and the summary are the bench's own code.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any

import pytest

from loadtest import bench, bench_cache, bench_hops, bench_loads, bench_servers, figures
from loadtest.stats import RequestRecord, summarize

CAPACITY = {"naive": 3.5, "monolith": 7.5, "prism": 6.5}


def _records(n: int, fast: bool, kind: str = "text", trace: bool = False, ttft: float = 0.1) -> list[RequestRecord]:
    ttft = ttft if fast else 3.0
    spans = None
    if trace:  # (what the cache-reach figures read from a trace)
        spans = {
            "spans": [{"name": "prefill", "duration_ms": 10.0}],
            "cache": {"encoder": {"hits": 1, "misses": 0}, "prefix": {"cached_visual_tokens": 0}, "routing": {}},
            "visual_tokens": 10,
        }
    return [
        RequestRecord(kind, i * 0.5, 200, ttft_s=ttft, e2e_s=ttft + 0.1, itl_s=[0.01] * 7, output_tokens=8, trace=spans)
        for i in range(n)
    ]


def _hops() -> dict[str, Any]:
    one = {"requests": 2, "traced_ok": 2, "ttft_p50_ms": 30.0, "hops_p50_ms": {}, "hops_total_p50_ms": 0.0}
    return {"n": 2, "text": {**one, "spans_p50_ms": {}}, "one_small_image": {**one, "spans_p50_ms": {}}}


@pytest.fixture
def fake_bench(monkeypatch, tmp_path):
    ran: dict[str, list[float]] = {}

    @contextmanager
    def prism_app(config: dict[str, Any], key: str = "") -> Any:
        deployments = config.get("deployments", {})
        inside = " in ingress" if deployments.get("in_ingress") else ""
        yield f"fake://prism/{deployments.get('topology', 'E/P/D')}{inside}"

    @contextmanager
    def subprocess_server(module: str, args: list[str]) -> Any:
        yield f"fake://{module.rsplit('.', 1)[-1]}"

    def server(url: str) -> str:
        return url.split("/")[2]

    def mixed(url: str, model: str, rate: float, duration: float, seed: int = 21, image_seed: int | None = None):
        ran.setdefault(url, []).append(rate)
        n = int(rate * duration)
        capacity = CAPACITY[server(url)]
        # (past its capacity a server carries less the harder it is pushed: 85 % of it, then 15 % less per rps)
        carried = capacity * (0.85 if rate < capacity + 1 else 0.85 - 0.15 * (rate - capacity))
        kept = n if rate <= capacity else min(n, int(max(0.1, carried) * duration))
        records = _records(kept, True) + _records(n - kept, False)
        return summarize(records, duration, bench_loads.SLO_MIXED), records

    def load(url: str, model: str, workload: Any, rate: float, duration: float, seed: int, key: str = "") -> list:
        return _records(4, True, "image", trace=True)

    def flood(url: str, model: str, duration: float, base: int, *args: Any, idle: list | None = None, **kw: Any):
        own = _records(5, True, ttft=0.1 + base / 1e4)  # (each load's idle probes of their own TTFT)
        return bench_loads.Flood(idle if idle is not None else own, _records(5, True), _records(3, True))

    monkeypatch.setattr(bench_servers, "prism_app", prism_app)
    monkeypatch.setattr(bench_servers, "subprocess_server", subprocess_server)
    monkeypatch.setattr(bench_loads, "mixed", mixed)
    monkeypatch.setattr(bench_loads, "load", load)
    monkeypatch.setattr(bench_loads, "flood", flood)
    monkeypatch.setattr(bench_hops, "hop_costs", lambda *a, **k: _hops())
    monkeypatch.setattr(bench_cache, "prime", lambda *a, **k: None)
    stand_in = {f.name: figures.record(f.name, [1.0], {}) for f in figures.FIGURES}
    monkeypatch.setattr(bench.bench_engine, "decode_figures", lambda *a, **k: dict(stand_in))
    monkeypatch.setattr(bench.bench_engine, "grammar_figures", lambda *a, **k: {})
    monkeypatch.setattr(bench.bench_engine, "transfer_figures", lambda *a, **k: {})
    monkeypatch.setattr(bench, "QUICK", tmp_path)
    return ran, tmp_path


def test_the_bench_runs_every_session_and_writes_every_figure(fake_bench):
    ran, out = fake_bench
    path = bench.main(["--quick", "--out", str(out / "summary.json")])
    summary = json.loads(path.read_text())
    assert set(summary["metrics"]) == {f.name for f in figures.FIGURES}
    # The sweeps: down from START while behind, up past each server's peak; Prism and the monolith also at the naive
    # server's knee. (The naive server is past its peak at 5 already: no run above it.)
    assert ran["fake://naive"] == [5.0, 4.0, 3.0]
    assert ran["fake://monolith"] == [5.0, 6.0, 7.0, 8.0, 4.0]
    assert ran["fake://prism/E/P/D"] == [5.0, 6.0, 7.0, 4.0]
    assert ran["fake://prism/EPD"] == [5.0, 6.0, 7.0]  # (a topology's sweep: no extra rate)
    assert "fake://prism/MEPD in ingress" in ran
    raw = summary["metrics"]["goodput_ratio_vs_naive"]["raw"]
    assert raw["at_naive_knee"]["rate_rps"] == 4.0 and raw["at_naive_knee"]["prism"] is not None
    assert all(s["peak_located"] for s in raw["servers"].values())
    assert summary["metrics"]["goodput_ratio_vs_monolith"]["value"] == pytest.approx(6.0 / 7.0)
    # The flood figures of a run share the text flood's idle probes.
    tenants = summary["metrics"]["tenant_ttft_p95_flood_vs_idle"]["raw"]  # (one run: its raw as it is)
    text = summary["metrics"]["text_ttft_p95_flood_vs_idle"]["raw"]
    assert tenants["idle_p95_s"] == text["prism_idle_p95_s"] == pytest.approx(0.1 + bench_loads.seed_of("flood") / 1e4)
    assert summary["duration_s_per_run"] == 8.0 and all((out / p.rsplit("/", 1)[-1]).exists() for p in summary["plots"])


def test_the_sweep_runs_are_shorter_than_the_other_loads():
    full, quick = bench.Settings(False, None), bench.Settings(True, None)
    assert (full.duration, full.sweep_duration) == (20.0, 16.0) and quick.sweep_duration == quick.duration == 8.0
