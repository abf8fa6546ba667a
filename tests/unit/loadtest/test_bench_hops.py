"""The per-hop report reads the hop spans of Prism's traces: queue, transfer, reserve and first-token spans are hops,
stage work is not; p50s over the ok, traced requests only."""

from __future__ import annotations

from loadtest.bench_hops import is_hop, summarize, table
from loadtest.stats import RequestRecord


def _record(ttft_s: float, spans: dict[str, float], status: int = 200) -> RequestRecord:
    trace = {"spans": [{"name": n, "duration_ms": ms} for n, ms in spans.items()]}
    return RequestRecord("text", 0.0, status, ttft_s=ttft_s, trace=trace)


def test_hops_are_the_spans_between_deployments():
    assert [
        n
        for n in ("ingress", "media.queue", "encode.transfer", "decode.reserve", "prefill", "first_token")
        if is_hop(n)
    ] == ["media.queue", "encode.transfer", "decode.reserve", "first_token"]


def test_summary_takes_p50s_of_ok_traced_requests():
    records = [
        _record(0.1, {"ingress": 5, "prefill.transfer": 2, "prefill": 30, "decode.queue": 4}),
        _record(0.3, {"ingress": 7, "prefill.transfer": 6, "prefill": 50, "decode.queue": 8}),
        _record(9.0, {"prefill.transfer": 900}, status=429),  # (refused: left out)
        RequestRecord("text", 0.0, 200, ttft_s=0.2),  # (no trace: left out)
    ]
    out = summarize(records)
    assert (out["requests"], out["traced_ok"], out["ttft_p50_ms"]) == (4, 2, 200.0)
    assert out["hops_p50_ms"] == {"prefill.transfer": 4.0, "decode.queue": 6.0}
    assert out["hops_total_p50_ms"] == 10.0 and out["spans_p50_ms"]["prefill"] == 40.0


def test_the_table_puts_servers_side_by_side():
    prism = summarize([_record(0.2, {"prefill.transfer": 5, "decode.reserve": 6, "prefill": 30})])
    mono = summarize([_record(0.1, {"prefill.transfer": 0.5, "prefill": 30})])
    report = {"n": 1, "text": prism, "one_small_image": prism}
    text = table({"prism": report, "monolith": {"n": 1, "text": mono, "one_small_image": mono}})
    assert "| Hop (p50 ms) | prism | monolith |" in text
    assert "| text: `decode.reserve` | 6.0 | — |" in text and "| text: `TTFT` | 200.0 | 100.0 |" in text
    assert table({"prism": {}}) == ""
