"""``make bench``'s topology session: the same Prism application in each grouped topology (``E/PD``, ``EP/D``, ``EPD``,
``MEPD``, and ``MEPD`` in the ingress replica, with one ingress replica and with two; ``E/P/D`` is Prism's own session),
each against the monolith built from the same stage classes. (``ME/P/D`` and ``ME/PD`` are left out for the bench's
time: on this machine they differ from ``E/P/D`` and ``E/PD`` by the one hop that ``MEPD`` measures against ``EPD``.)

Per topology, one application of its own on this machine (one at a time, as every server of the bench): warm-up, the
per-hop report (:mod:`loadtest.bench_hops`), the light load of medium images behind the TTFT figures (the same runs,
seeds and count as ``ttft_ratio_epd_vs_monolith``; one run for a topology without a figure), then the goodput sweep
(:func:`loadtest.sweep.next_rate`: from :data:`loadtest.sweep.START` down while behind, then up until past its peak).
Four figures come from it:

* ``ttft_ratio_topology_epd_vs_monolith`` — the ``EPD`` topology's TTFT p50 over the monolith's, run i against run i
  (median of the runs, its spread beside it): what Serve's hops cost when the model's stages share one replica;
* ``ttft_ratio_topology_mepd_vs_monolith`` — the same for ``MEPD`` (media in that replica too: the ingress's one call);
* ``ttft_ratio_topology_mepd_in_ingress_vs_monolith`` — the same for ``MEPD`` inside the ingress replica
  (``deployments.in_ingress``: no Serve hop after the proxy);
* ``peak_goodput_best_topology_vs_monolith`` — the best topology's peak goodput over the swept rates (``E/P/D``
  included) over the monolith's.

Every topology's TTFT runs and sweep go in the raw numbers (``topologies``), and
``loadtest/results/bench_topology_goodput.png`` plots each topology's goodput against the offered rate beside the
monolith's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

from common.config.topology import Stage
from loadtest import bench_hops
from loadtest import bench_loads as loads
from loadtest import bench_servers as servers
from loadtest.bench_plots import goodput_vs_rate
from loadtest.bench_sessions import Say, ServerRuns, light, warm_up
from loadtest.bench_settings import Settings
from loadtest.figures import record

IN_INGRESS = "MEPD in ingress"
"""``MEPD`` with ``deployments.in_ingress``: the model's stages inside the ingress replica (no Serve hop after the
proxy)."""
IN_INGRESS_X2 = "MEPD in ingress ×2"
"""The same with two ingress replicas — two copies of the whole model, each with its own engines, behind Serve's proxy:
what a model this small does with a second process on the same cores (each replica's stages ask :data:`X2_STAGE_CPUS`
so that both fit the machine's CPUs beside the ingresses' own shares)."""
X2_STAGE_CPUS = 0.1
"""CPUs each stage of an :data:`IN_INGRESS_X2` replica asks: 2 × (0.1 + 4 × 0.1) = 1 of a 2-CPU machine (at the other
topologies' 0.25, two replicas would ask 2.2, and Serve would never start the second). A share is a reservation only —
the threads are the same as in every other topology (``model.torch_threads``)."""
GROUPED = ("E/PD", "EP/D", "EPD", "MEPD", IN_INGRESS, IN_INGRESS_X2)
WITH_TTFT_FIGURE = ("EPD", "MEPD", IN_INGRESS)
"""The topologies with a TTFT figure of their own (``ttft_ratio_topology_<name>_vs_monolith``); the others' TTFT runs
go in the raw numbers only."""
PNG = "bench_topology_goodput.png"


def with_topology(config: dict[str, Any], topology: str) -> dict[str, Any]:
    """``config`` with ``topology`` (one of :data:`GROUPED`, or ``E/P/D``) set for its model."""
    deployments = {**config.get("deployments", {}), "topology": topology.split()[0]}
    if topology.startswith(IN_INGRESS):
        deployments["in_ingress"] = True
    if topology == IN_INGRESS_X2:
        for stage in get_args(Stage):
            deployments[stage] = {**deployments.get(stage, {}), "num_cpus": X2_STAGE_CPUS}
        deployments["ingress"] = {**deployments.get("ingress", {}), "min_replicas": 2, "max_replicas": 2}
    return {**config, "deployments": deployments}


def figure_key(name: str) -> str:
    """A topology's name as it appears in its figure's name: ``MEPD in ingress`` → ``mepd_in_ingress``."""
    return name.lower().replace(" ", "_")


def session(config: dict[str, Any], model: str, st: Settings, say: Say) -> dict[str, ServerRuns]:
    """Each grouped topology's runs (see the module docstring)."""
    out = {}
    for topology in GROUPED:
        runs = out[topology] = ServerRuns()
        with servers.prism_app(with_topology(config, topology)) as url:
            warm_up(url, model)
            say(f"topology {topology}: the fixed cost of each hop, then the light load of medium images")
            runs.hops = bench_hops.hop_costs(url, model, st.hop_requests, api_key=servers.KEY)
            for i in range(_light_runs(topology, st)):
                runs.cold.append(light(url, model, st, i))
            say(f"topology {topology}: the goodput sweep")
            runs.sweep = loads.sweep(url, model, st.sweep_duration, st.min_requests)
    return out


def _light_runs(topology: str, st: Settings) -> int:
    """How many runs of the light load ``topology`` sends: its figure's runs where it has a TTFT figure
    (:data:`WITH_TTFT_FIGURE`), else one — its TTFT against the monolith's first run stays in the raw numbers, and the
    two runs more cost 40 s of the bench's 35 minutes each."""
    key = f"ttft_ratio_topology_{figure_key(topology)}_vs_monolith"
    return st.runs(key) if topology in WITH_TTFT_FIGURE else 1


def figures(
    prism: ServerRuns, mono: ServerRuns, grouped: dict[str, ServerRuns], plots_dir: Path
) -> tuple[dict[str, Any], Path]:
    """The four figures (see the module docstring), and the plot of every topology's sweep."""
    everyone = {"E/P/D": prism, **grouped}
    ttft = dict(_ttft_figure(name, grouped[name], mono) for name in WITH_TTFT_FIGURE if name in grouped)
    curves = {name: loads.curve(runs.sweep) for name, runs in {**everyone, "monolith": mono}.items()}
    peaks = {name: curves[name]["peak_goodput_rps"] for name in everyone}
    best = max(peaks, key=peaks.__getitem__)
    mono_peak = curves["monolith"]["peak_goodput_rps"]
    per_topology = {
        name: {
            "ttft_p50_s": [loads.ttft(run) for run in runs.cold],
            "ttft_ratio_vs_monolith": [
                loads.ratio(loads.ttft(a), loads.ttft(b)) for a, b in zip(runs.cold, mono.cold, strict=False)
            ],
            **curves[name],
            "per_hop_fixed_cost": runs.hops,
        }
        for name, runs in everyone.items()
    }
    goodput = record(
        "peak_goodput_best_topology_vs_monolith",
        [loads.ratio(peaks[best], mono_peak)],
        {"best": best, "monolith_peak_goodput_rps": mono_peak, "topologies": per_topology},
        sides={
            f"{best} at the lowest rate": everyone[best].sweep[min(everyone[best].sweep)][1],
            "monolith at the lowest rate": mono.sweep[min(mono.sweep)][1],
        },
        goodput={f"{best} at its peak": peaks[best], "monolith at its peak": mono_peak},
    )
    rows = {name: c["sweep"] for name, c in curves.items()}
    plot = goodput_vs_rate(plots_dir / PNG, rows, None, "Goodput vs offered load, per topology (mixed workload)")
    return {**ttft, "peak_goodput_best_topology_vs_monolith": goodput}, plot


def _ttft_figure(name: str, runs: ServerRuns, mono: ServerRuns) -> tuple[str, dict[str, Any]]:
    """``name``'s TTFT p50 over the monolith's, run i against run i: the figure's name and its record."""
    figure = f"ttft_ratio_topology_{figure_key(name)}_vs_monolith"
    pairs = list(zip(runs.cold, mono.cold, strict=False))  # (the monolith's runs are the TTFT figure's: as many)
    key = f"{figure_key(name)}_ttft_p50_s"
    raw = [{key: loads.ttft(t), "monolith_ttft_p50_s": loads.ttft(m), "requests": len(t)} for t, m in pairs]
    return figure, record(
        figure,
        [loads.ratio(loads.ttft(t), loads.ttft(m)) for t, m in pairs],
        raw,
        sides={name: [r for run in runs.cold for r in run], "monolith": [r for run in mono.cold for r in run]},
    )
