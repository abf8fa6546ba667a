"""The load generator's arithmetic: arrival processes, percentiles, goodput, workloads, CLI argument checks."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from loadtest.__main__ import main
from loadtest.arrivals import arrival_times
from loadtest.stats import SLO, RequestRecord, percentile, summarize
from loadtest.workload import OutputLengths, Workload, parse_weights


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    times = arrival_times("poisson", rate=5.0, duration_s=2000.0, seed=1)
    assert abs(len(times) / 2000.0 - 5.0) < 0.25
    gaps = np.diff([0.0, *times])
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV 1
    assert times == arrival_times("poisson", rate=5.0, duration_s=2000.0, seed=1)  # reproducible
    assert max(times) < 2000.0 and times == sorted(times)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_arrivals_keep_the_rate_and_change_burstiness(cv):
    times = arrival_times("gamma", rate=4.0, duration_s=3000.0, seed=2, cv=cv)
    assert abs(len(times) / 3000.0 - 4.0) < 0.3
    gaps = np.diff([0.0, *times])
    assert abs(gaps.std() / gaps.mean() - cv) < 0.15 * cv


def test_arrival_arguments_are_checked():
    with pytest.raises(ValueError):
        arrival_times("poisson", rate=0, duration_s=1)
    with pytest.raises(ValueError):
        arrival_times("gamma", rate=1, duration_s=1, cv=0)


def test_percentiles_on_known_data():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5 and percentile([], 50) is None
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    data = [random.Random(3).random() for _ in range(1001)]
    for p in (50, 95, 99):
        assert percentile(data, p) == pytest.approx(float(np.percentile(data, p)))
    with pytest.raises(ValueError):
        percentile([1], 101)


def _rec(ttft, itl, status=200, code="ok", kind="text", tokens=None):
    e2e = ttft + sum(itl)
    return RequestRecord(kind, 0.0, status, code, ttft, e2e, list(itl), tokens or len(itl) + 1)


def test_summary_goodput_and_outcomes():
    records = [
        _rec(0.5, [0.05] * 9),  # good
        _rec(3.0, [0.05] * 9),  # TTFT too slow
        _rec(0.5, [0.5] * 3),  # ITL too slow
        RequestRecord("image", 0.0, 429, "server_overloaded"),
        _rec(0.2, [], kind="image", tokens=1),  # one token, no ITL: good
    ]
    s = summarize(records, duration_s=10.0, slo=SLO(ttft_s=1.0, itl_s=0.1))
    assert s["requests"] == 5 and s["ok"] == 4 and s["rejected_429"] == 1
    assert s["goodput_rps"] == pytest.approx(0.2) and s["slo_attainment"] == pytest.approx(0.4)
    assert s["outcomes"] == {"200 ok": 4, "429 server_overloaded": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_s"]["count"] == 4
    assert s["tpot_s"]["count"] == 3 and records[0].tpot_s == pytest.approx(0.05)
    assert s["by_kind"] == {"image": 2, "text": 3}
    assert s["output_tokens_per_s"] == pytest.approx((10 + 10 + 4 + 1) / 10.0)


def test_workload_mix_sizes_cache_and_lengths():
    w = Workload(mix={"text": 1, "image": 1}, sizes={"small": 1}, cache="hot", outputs=OutputLengths("uniform:4-8"))
    kinds, urls, lengths = [], set(), []
    for _ in range(200):
        kind, body = w.next_request("m")
        kinds.append(kind)
        lengths.append(body["max_tokens"])
        if kind == "image":
            urls.add(body["messages"][0]["content"][0]["image_url"]["url"])
    assert 70 < kinds.count("image") < 130 and len(urls) == 1  # hot: the same image again and again
    assert min(lengths) >= 4 and max(lengths) <= 8
    cold = Workload(mix={"image": 1}, sizes={"small": 1}, cache="cold", seed=5)
    cold_urls = {cold.next_request("m")[1]["messages"][0]["content"][0]["image_url"]["url"] for _ in range(5)}
    assert len(cold_urls) == 5
    assert statistics.mean(OutputLengths("exp:20").sample(random.Random(i)) for i in range(2000)) == pytest.approx(
        20, rel=0.15
    )
    with pytest.raises(ValueError):
        parse_weights("text=1,sound=2", ("text", "image"))
    with pytest.raises(ValueError):
        OutputLengths("normal:3").sample(random.Random(0))


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "--rates" in capsys.readouterr().out
    assert main(["--url", "http://127.0.0.1:9/v1", "--mix", "text=0"]) == 2


def test_bench_table_goes_between_the_doc_markers(tmp_path):
    from loadtest.bench import END, START, table, update_doc
    from loadtest.figures import FIGURES, record

    metrics = {f.name: record(f.name, [1.0], {"x": 1}) for f in FIGURES}
    summary = {
        "date": "2026-11-30T00:00:00+00:00",
        "machine": {"cpus": 2, "platform": "p"},
        "model": "m",
        "wall_s": 5.0,
        "metrics": metrics,
    }
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"before\n{START}\nSTALE-TABLE\n{END}\nafter\n")
    update_doc(summary, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "STALE-TABLE" not in text
    assert table(summary, doc.parent) in text and text.count("| `") == len(FIGURES)
    assert metrics["ttft_ratio_epd_vs_monolith"]["met"] and not metrics["goodput_ratio_vs_naive"]["met"]


def test_the_docs_bench_table_is_the_committed_summary():
    import json

    from loadtest.bench import DOC, END, RESULTS, START, table

    block = DOC.read_text().split(START)[1].split(END)[0].strip()
    summary = RESULTS / "summary.json"
    if summary.exists():
        data = json.loads(summary.read_text())
        assert block == table(data)
        assert set(data["metrics"]) >= {"ttft_ratio_epd_vs_monolith", "goodput_ratio_vs_naive"}
        for m in data["metrics"].values():
            assert {"value", "target", "met", "raw"} <= set(m) and m["raw"]
    else:
        assert "not measured yet" in block
