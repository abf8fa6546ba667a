"""The one place figures are declared, and how a figure's runs become its value: the median, the spread beside it,
side counts summed over the runs, a run without a value making the whole figure invalid."""

from __future__ import annotations

import math

import pytest

from loadtest import bench_cache, bench_topology, figures
from loadtest.bench import Settings, table
from loadtest.stats import RequestRecord
from tests.paths import ROOT


def _ok(n: int) -> list[RequestRecord]:
    return [RequestRecord("text", 0.0, 200, ttft_s=0.1, e2e_s=0.2, output_tokens=4) for _ in range(n)]


def _failed(n: int) -> list[RequestRecord]:
    return [RequestRecord("text", 0.0, 500, code="internal_error") for _ in range(n)]


SHORT = (
    "ttft_ratio_epd_vs_monolith",
    "ttft_ratio_topology_epd_vs_monolith",
    "ttft_ratio_topology_mepd_vs_monolith",
    "ttft_ratio_topology_mepd_in_ingress_vs_monolith",
    "encoder_cache_hot_cold_ttft_ratio",
    "encoder_hit_rate_2_replicas",
    "prefix_reuse_fraction",
    "text_ttft_p95_flood_vs_idle",
    "tenant_ttft_p95_flood_vs_idle",
    "tenants3_ttft_p95_flood_vs_idle",
    "decode_speedup_32_vs_sequential",
    "decode_roofline_fraction_b32",
    "grammar_mask_fraction_of_b32_step",
    "handoff_bw_fraction_of_memcpy",
    "nixl_bw_fraction_of_memcpy",
    "nixl_vs_ucx_read",
)


def test_every_figure_is_declared_once_with_a_target_and_short_figures_repeat():
    names = [f.name for f in figures.FIGURES]
    assert len(names) == len(set(names)) == 20
    assert all(f.op in ("<=", ">=") and f.target > 0 for f in figures.FIGURES)
    assert all(figures.runs(n) >= 3 for n in SHORT)
    # the two decode figures come from the same runs of bench_decode, the NIXL two from the same repeats
    assert figures.runs("decode_speedup_32_vs_sequential") == figures.runs("decode_roofline_fraction_b32")
    assert figures.runs("decode_speedup_32_vs_sequential") == figures.runs("decode_speedup_32_vs_engine_b1")
    assert figures.runs("nixl_bw_fraction_of_memcpy") == figures.runs("nixl_vs_ucx_read")
    # the topologies' TTFT runs pair with the monolith's runs of the split path's figure, one for one
    assert figures.runs("ttft_ratio_topology_epd_vs_monolith") == figures.runs("ttft_ratio_epd_vs_monolith")
    assert figures.runs("ttft_ratio_topology_mepd_vs_monolith") == figures.runs("ttft_ratio_epd_vs_monolith")
    assert figures.runs("ttft_ratio_topology_mepd_in_ingress_vs_monolith") == figures.runs("ttft_ratio_epd_vs_monolith")
    # a topology with a TTFT figure runs the light load as often as its figure; one without, once (raw only)
    full = Settings(False, None)
    for name in bench_topology.GROUPED:
        with_figure = f"ttft_ratio_topology_{bench_topology.figure_key(name)}_vs_monolith" in figures.BY_NAME
        assert (name in bench_topology.WITH_TTFT_FIGURE) == with_figure
        assert bench_topology._light_runs(name, full) == (
            figures.runs("ttft_ratio_epd_vs_monolith") if with_figure else 1
        )
    # the three-tenant runs take their idle probes from the two-tenant figure's, run for run
    assert figures.runs("tenants3_ttft_p95_flood_vs_idle") == figures.runs("tenant_ttft_p95_flood_vs_idle")
    # the three cache-reach figures come from the same hot runs
    assert len({figures.runs(n) for n in bench_cache.FIGURES}) == 1


def test_run_counts_are_odd_so_the_median_is_one_of_the_runs():
    with pytest.raises(ValueError, match="odd"):
        figures.Figure("x", "<=", 1.0, runs=2)
    assert figures.median_index([5.0, 1.0, 3.0]) == 2 and figures.median_index([4.0, 1.0, 3.0, 2.0]) == 3
    assert figures.spread([0.0, 0.0, 1.0])["relative"] is None  # (not inf: summary.json stays standard JSON)


def test_no_two_loads_of_a_full_bench_share_a_seed():
    """A workload's seed decides its images: a shared seed would serve one load's images warm to another."""
    from loadtest.bench_loads import SEEDS, seed_of
    from loadtest.sweep import RATES

    runs = max(f.runs for f in figures.FIGURES)
    used: list[int] = [seed_of("warm_up")]
    for i in range(runs):
        used += [seed_of("cold", i), seed_of("cache_cold", i), seed_of("cache_hot", i)]
        used += [seed_of(flood, i) + k for flood in ("flood", "tenant_flood") for k in range(3)]
        used += [seed_of("tenants3_flood", i) + k for k in range(1, 4)]  # (its idle probes are tenant_flood's)
    used += [seed_of("sweep") + i for i in range(len(RATES))]
    assert len(used) == len(set(used)), sorted(used)
    assert set(SEEDS) == {
        "warm_up",
        "cold",
        "flood",
        "tenant_flood",
        "tenants3_flood",
        "cache_cold",
        "cache_hot",
        "sweep",
    }


def test_the_value_is_the_median_of_the_runs_with_the_spread_beside_it():
    m = figures.record("ttft_ratio_epd_vs_monolith", [1.3, 0.9, 1.0], [{"run": 1}, {"run": 2}, {"run": 3}])
    assert m["value"] == 1.0 and m["status"] == "met" and m["runs"] == 3 and m["values"] == [1.3, 0.9, 1.0]
    assert m["spread"]["min"] == 0.9 and m["spread"]["max"] == 1.3
    assert m["spread"]["relative"] == pytest.approx(0.4)
    assert m["raw"] == {"runs": [{"run": 1}, {"run": 2}, {"run": 3}]}
    one = figures.record("goodput_ratio_vs_naive", [3.5], {"x": 1})
    assert one["runs"] == 1 and "spread" not in one and one["raw"] == {"x": 1} and one["met"]


def test_a_run_without_a_value_makes_the_figure_invalid_not_a_median_of_the_survivors():
    m = figures.record("text_ttft_p95_flood_vs_idle", [1.2, None, 1.1], [{}, {}, {}])
    assert m["status"] == "invalid" and m["value"] is None and not m["met"]
    assert m["invalid_reason"] == "1 of 3 runs gave no finite value"
    assert figures.record("text_ttft_p95_flood_vs_idle", [1.2, math.inf, 1.1], {})["status"] == "invalid"


def test_side_counts_are_summed_over_the_runs_and_judged_once():
    # 1 failure in 3 x 50 requests is under 1 %; the same failure in one run of 50 would be 2 %
    sides = {"prism": _ok(50) + _ok(49) + _failed(1) + _ok(50)}
    m = figures.record("ttft_ratio_epd_vs_monolith", [1.0, 1.0, 1.0], {}, sides=sides)
    assert m["sides"]["prism"]["requests"] == 150 and m["sides"]["prism"]["errors"] == 1 and m["status"] == "met"
    lone = figures.record("ttft_ratio_epd_vs_monolith", [1.0], {}, sides={"prism": _ok(49) + _failed(1)})
    assert lone["status"] == "invalid"


def test_raw_numbers_are_one_dict_or_one_per_run():
    with pytest.raises(ValueError, match="one, or one per run"):
        figures.record("ttft_ratio_epd_vs_monolith", [1.0, 1.0, 1.0], [{}, {}])
    with pytest.raises(ValueError):
        figures.record("ttft_ratio_epd_vs_monolith", [], {})


def test_the_table_shows_runs_and_spread_marks_our_yardsticks_and_links_the_plots():
    metrics = {
        "prefix_reuse_fraction": figures.record("prefix_reuse_fraction", [0.3, 0.25, 0.28], {}),
        "goodput_ratio_vs_naive": figures.record("goodput_ratio_vs_naive", [4.0], {}),
        "goodput_ratio_vs_monolith": figures.record("goodput_ratio_vs_monolith", [0.9], {}),
    }
    summary = {
        "date": "2026-12-01T00:00:00+00:00",
        "machine": {"cpus": 2, "platform": "p"},
        "model": "m",
        "wall_s": 1.0,
        "plots": ["loadtest/results/bench_goodput_vs_rate.png"],
        "metrics": metrics,
    }
    text = table(summary, ROOT)  # (a page at the repository's root links the plots from there)
    assert "| `prefix_reuse_fraction` | 0.28 | 3 (0.25–0.3) | >= 0.8 | no |" in text
    assert "| `goodput_ratio_vs_monolith` | 0.9 | 1 | >= 1 (ours) | no |" in text
    assert "| `goodput_ratio_vs_naive` | 4 | 1 | >= 3 | yes |" in text
    assert text.endswith("Plots: [goodput vs rate](loadtest/results/bench_goodput_vs_rate.png).")
    assert "Measured 2026-12-01 on 2 CPUs (p), model `m`" in text  # (a summary without the CPU's facts)
    summary["machine"] |= {"cpu_model": "AMD EPYC", "kernel_flags": ["avx2", "avx512_bf16"]}
    assert "Measured 2026-12-01 on 2 CPUs of AMD EPYC (avx2, avx512_bf16) (p), model `m`" in table(summary, ROOT)
    in_docs = table(summary)  # (docs/benchmarks.md, where make bench writes it)
    assert in_docs.endswith("Plots: [goodput vs rate](../loadtest/results/bench_goodput_vs_rate.png).")


def test_quick_runs_every_figure_once_on_shorter_loads():
    quick, full = Settings(quick=True, duration=None), Settings(quick=False, duration=None)
    assert quick.duration < full.duration and quick.min_requests < full.min_requests
    assert all(quick.runs(n) == 1 and full.runs(n) == figures.runs(n) for n in SHORT)
    assert list(quick.ucx_transports) == ["default"] and "tcp" in full.ucx_transports
    assert Settings(quick=True, duration=3.0).duration == 3.0


def _runs(ttft_s: float, goodputs: dict[float, float], attainment: dict[float, float] | None = None):
    from loadtest.bench_sessions import ServerRuns
    from loadtest.stats import SLO, summarize

    def records(n: int) -> list[RequestRecord]:
        return [RequestRecord("image", 0.0, 200, ttft_s=ttft_s, e2e_s=ttft_s + 0.1, output_tokens=4) for _ in range(n)]

    sweep = {}
    for rate, good in goodputs.items():
        summary = summarize(records(10), 10.0, SLO())
        kept = (attainment or {}).get(rate, summary["slo_attainment"])
        sweep[rate] = ({**summary, "goodput_rps": good, "slo_attainment": kept}, records(10))
    return ServerRuns(cold=[records(10) for _ in range(3)], sweep=sweep)


def test_topology_figures_compare_epd_with_the_monolith_and_the_best_peak_goodput(tmp_path):
    """EPD's TTFT against the monolith's, run for run; the best topology (E/P/D included) by its peak goodput; every
    topology's raw runs and the plot of their sweeps."""
    from loadtest import bench_topology

    mono = _runs(0.100, {1.0: 1.0, 2.0: 1.5})
    prism = _runs(0.140, {1.0: 1.0, 2.0: 1.2})
    grouped = {
        "E/PD": _runs(0.120, {1.0: 1.0, 2.0: 1.4}),
        "EP/D": _runs(0.130, {1.0: 1.0, 2.0: 1.3}),
        "EPD": _runs(0.103, {1.0: 1.0, 2.0: 1.6}),
        "MEPD": _runs(0.110, {1.0: 1.0, 2.0: 1.55}),
        "MEPD in ingress": _runs(0.104, {1.0: 1.0, 2.0: 1.5}),
    }
    got, plot = bench_topology.figures(prism, mono, grouped, tmp_path)
    ttft = got["ttft_ratio_topology_epd_vs_monolith"]
    assert ttft["value"] == pytest.approx(1.03) and ttft["met"] and ttft["runs"] == 3
    mepd = got["ttft_ratio_topology_mepd_vs_monolith"]
    assert mepd["value"] == pytest.approx(1.10) and not mepd["met"] and "mepd_ttft_p50_s" in mepd["raw"]["runs"][0]
    peak = got["peak_goodput_best_topology_vs_monolith"]
    assert peak["raw"]["best"] == "EPD" and peak["value"] == pytest.approx(1.6 / 1.5) and peak["met"]
    per = peak["raw"]["topologies"]
    assert set(per) == {"E/P/D", "E/PD", "EP/D", "EPD", "MEPD", "MEPD in ingress"}
    assert per["E/P/D"]["peak_goodput_rps"] == 1.2
    inside = got["ttft_ratio_topology_mepd_in_ingress_vs_monolith"]
    assert inside["value"] == pytest.approx(1.04) and inside["met"]
    assert "mepd_in_ingress_ttft_p50_s" in inside["raw"]["runs"][0]
    assert [row["rate_rps"] for row in per["E/PD"]["sweep"]] == [1.0, 2.0] and per["E/PD"]["peak_at_rps"] == 2.0
    assert plot.name == bench_topology.PNG and plot.read_bytes()[:4] == b"\x89PNG"


def test_the_goodput_figures_are_ratios_of_peak_goodput_with_each_servers_capacity_in_the_raw():
    """Prism's peak over the naive server's and over the monolith's, wherever on the sweep each peak lies; the
    at-knee goodputs (the naive server's first rate under 90 %) stay in the raw."""
    from loadtest import bench_results

    naive = _runs(0.2, {1.0: 0.9, 2.0: 1.6, 3.0: 0.4}, {1.0: 1.0, 2.0: 0.8, 3.0: 0.1})
    prism = _runs(0.1, {1.0: 0.9, 2.0: 1.9, 3.0: 2.4, 4.0: 1.0}, {1.0: 1.0, 2.0: 1.0, 3.0: 0.85, 4.0: 0.3})
    mono = _runs(0.1, {1.0: 0.9, 2.0: 1.9, 3.0: 2.8, 4.0: 3.0}, {1.0: 1.0, 2.0: 1.0, 3.0: 0.95, 4.0: 0.8})
    got = bench_results.goodput(naive, prism, mono)
    assert got["goodput_ratio_vs_naive"]["value"] == pytest.approx(2.4 / 1.6)
    assert got["goodput_ratio_vs_monolith"]["value"] == pytest.approx(2.4 / 3.0)
    assert got["goodput_ratio_vs_monolith"]["status"] == "missed"
    servers = got["goodput_ratio_vs_naive"]["raw"]["servers"]
    naive_curve = {"capacity_rps": 1.0, "knee_rps": 2.0, "peak_goodput_rps": 1.6, "peak_at_rps": 2.0}
    assert servers["naive"] == {**naive_curve, "peak_located": True}
    assert servers["prism"]["capacity_rps"] == 2.0 and servers["prism"]["peak_at_rps"] == 3.0
    assert servers["prism"]["peak_located"]  # (3 rps: 2.4; 4 rps: behind, 1.0)
    assert servers["monolith"]["capacity_rps"] == 3.0 and servers["monolith"]["peak_at_rps"] == 4.0
    assert not servers["monolith"]["peak_located"]  # (its peak is the top rate that ran: at least that much)
    at_knee = got["goodput_ratio_vs_naive"]["raw"]["at_naive_knee"]
    assert at_knee == {"rate_rps": 2.0, "prism": 1.9, "monolith": 1.9, "naive": 1.6}
    assert [r["rate_rps"] for r in got["goodput_ratio_vs_naive"]["raw"]["sweep"]["naive"]] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("topology", ["EPD", "MEPD in ingress", "MEPD in ingress ×2"])
def test_each_benched_topology_builds_as_serve_deploys_it_within_the_cpus(topology):
    """The bench's config in each topology, built as Serve would deploy it: the grouped model's deployments (none
    where the ingress holds it), the replicas of ``×2`` (two ingress replicas that each hold the whole model), and CPU
    shares that Serve can place on this machine's 2 CPUs — at 2 or more it never starts the last replica."""
    from loadtest.bench import app_config
    from loadtest.bench_topology import GROUPED, with_topology
    from services.app import build_app
    from tests.unit.services.test_ray_configs import _deployments, _replicas

    assert topology in GROUPED
    built = {
        d.name: d for d in _deployments(build_app({"config": with_topology(app_config("prism-tiny-llava"), topology)}))
    }
    inside = topology.startswith("MEPD in ingress")
    assert set(built) == ({"Ingress"} if inside else {"Ingress", "Media", "EncodePrefillDecode"})
    assert _replicas(built["Ingress"]) == ((2, 2) if topology.endswith("×2") else (1, 1))
    assert sum(d.ray_actor_options["num_cpus"] * _replicas(d)[0] for d in built.values()) < 2
