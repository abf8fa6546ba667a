"""make bench's plots are written as PNGs from the sweep rows and the runs' records."""

from __future__ import annotations

from loadtest import bench_plots
from loadtest.stats import RequestRecord


def _records(ttfts):
    return [RequestRecord("text", 0.0, 200, ttft_s=t, e2e_s=t + 0.1, output_tokens=4) for t in ttfts]


def test_goodput_and_ttft_cdf_plots_are_pngs(tmp_path):
    rows = [{"rate_rps": r, "goodput_rps": g} for r, g in ((1.0, 1.0), (2.0, 1.5), (4.0, 1.1))]
    goodput = bench_plots.goodput_vs_rate(tmp_path / "g.png", {"prism": rows, "naive": rows[:2]}, 2.0)
    panels = {f"panel {i}": {"run a": _records([0.1, 0.2]), "run b": _records([])} for i in range(4)}
    panels["failed only"] = {"x": [RequestRecord("text", 0.0, 500, code="internal_error")]}
    cdf = bench_plots.ttft_cdfs(tmp_path / "c.png", panels)
    for path in (goodput, cdf):
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
