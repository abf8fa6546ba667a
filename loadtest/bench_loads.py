"""The load runs behind ``make bench``'s figures: light loads, text probes under a flood, the mixed load and its
rate sweep — each built before its clock starts (:func:`loadtest.runner.plan`) — and the figures read from them."""

from __future__ import annotations

import asyncio
from typing import Any

from loadtest.bench_servers import KEY
from loadtest.runner import RunSpec, plan, run
from loadtest.stats import SLO, RequestRecord, outcome_counts, summarize
from loadtest.sweep import MIN_REQUESTS, RATES, capacity, knee, next_rate, peak, peak_located, run_seconds
from loadtest.workload import OutputLengths, Workload

SLO_MIXED = SLO(ttft_s=2.0, itl_s=0.2)

SEEDS = {
    "warm_up": 99,
    "cold": 1,
    "flood": 11,
    "tenant_flood": 31,
    "tenants3_flood": 61,
    "cache_cold": 41,
    "cache_hot": 51,
    "sweep": 10_000,
}
"""Base seed of each load; a flood takes its base and the next two, the sweep one per rate. A workload's
seed decides its images (:class:`loadtest.workload.Workload`), so loads that must start cold must never share one."""
SEED_STRIDE = 1_000
"""Run ``i`` of a repeated figure uses its base + ``i`` × this: every run gets images of its own."""


SWEEP_SEQUENCE = 9_000
"""The goodput sweep's one sequence of arrivals and requests (its images come from ``sweep``'s seeds: one per rate).
Until 2026-12-05 each rate drew a sequence of its own, and the draws differed more than the rates did: the monolith
delivered 5.6, 4.2 and 7.1 rps of goodput at 6, 7 and 8 rps, its SLO attainment 1.0, 0.70 and 0.92."""


def seed_of(load: str, run: int = 0) -> int:
    return SEEDS[load] + run * SEED_STRIDE


def load(
    url: str, model: str, workload: Workload, rate: float, duration: float, seed: int, key: str = KEY
) -> list[RequestRecord]:
    spec = RunSpec(url=url, model=model, duration_s=duration, rate=rate, seed=seed, trace=True, api_key=key)
    records, _ = asyncio.run(run(spec, workload, progress=None))
    return records


def ttft(records: list[RequestRecord], p: str = "p50") -> float | None:
    """TTFT percentile of the ok requests (``None`` when none succeeded; the figure's side counts say how many)."""
    return summarize(records, 1.0, SLO())["ttft_s"][p]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def medium(cache: str, seed: int) -> Workload:
    return Workload(mix={"image": 1}, sizes={"medium": 1}, cache=cache, outputs=OutputLengths("fixed:16"), seed=seed)


class Flood:
    """The records of one flood figure: text probes idle, text probes under the flood, the flood itself."""

    def __init__(self, idle: list[RequestRecord], probes: list[RequestRecord], flood: list[RequestRecord]) -> None:
        self.idle, self.probes, self.flood = idle, probes, flood

    @property
    def ratio(self) -> float | None:
        return ratio(ttft(self.probes, "p95"), ttft(self.idle, "p95"))


def flood(
    url: str,
    model: str,
    duration: float,
    base: int,
    flood_key: str = KEY,
    probe_key: str = KEY,
    also_flooding: tuple[str, ...] = (),
    idle: list[RequestRecord] | None = None,
) -> Flood:
    """Text-only probes idle, then under a flood of large images at a steady rate (both loads planned first).
    Seeds ``base``, ``base + 1``, ``base + 2``: the idle probes, the probes under the flood, the flood (its images).
    ``also_flooding``: more tenants' keys, each sending a flood as large of its own (seeds ``base + 3``, …) at the same
    time; ``idle``: probes already measured idle in this run (then none are sent again)."""
    probe = Workload(mix={"text": 1}, outputs=OutputLengths("fixed:8"), seed=base)
    if idle is None:
        idle = load(url, model, probe, 1.0, duration, seed=base, key=probe_key)

    probe_spec = RunSpec(url=url, model=model, duration_s=duration, rate=1.0, seed=base + 1, api_key=probe_key)
    probes = Workload(mix={"text": 1}, outputs=OutputLengths("fixed:8"), seed=base + 1)
    floods = [
        _flood_load(url, model, duration, seed, key) for seed, key in enumerate((flood_key, *also_flooding), base + 2)
    ]
    # Every plan is built before any load starts: encoding the flood's large JPEGs (~1 s of CPU per request)
    # inside the running loop stalled the probes' own sends and timings and took the cores from the server.
    probe_plan = plan(probe_spec, probes)
    flood_plans = [plan(spec, images) for spec, images in floods]

    async def together():
        (records, _), *flooding = await asyncio.gather(
            run(probe_spec, probes, None, probe_plan),
            *(run(spec, images, None, p) for (spec, images), p in zip(floods, flood_plans, strict=True)),
        )
        return records, [r for got, _ in flooding for r in got]

    flooded, flooding = asyncio.run(together())
    return Flood(idle, flooded, flooding)


def _flood_load(url: str, model: str, duration: float, seed: int, key: str) -> tuple[RunSpec, Workload]:
    """One tenant's flood: large images (one or several a request) at 1.5 requests a second."""
    spec = RunSpec(url=url, model=model, duration_s=duration, rate=1.5, seed=seed, trace=False, api_key=key)
    images = Workload(
        mix={"image": 0.5, "multi_image": 0.5}, sizes={"large": 1}, outputs=OutputLengths("fixed:8"), seed=seed
    )
    return spec, images


Run = tuple[dict[str, Any], list[RequestRecord]]


def mixed(url: str, model: str, rate: float, duration: float, seed: int = 21, image_seed: int | None = None) -> Run:
    """The mixed open-loop load at ``rate``: ``seed`` decides the arrivals (Poisson, so one seed at several rates is
    one sequence, its gaps scaled by 1/rate) and the requests, ``image_seed`` (default: ``seed``) the images — each
    its own, so a run starts from cold caches (within a run, ``partial`` repeats some of its own images, as users
    do)."""
    workload = Workload(
        mix={"text": 0.4, "image": 0.4, "multi_image": 0.2},
        cache="partial",
        outputs=OutputLengths("uniform:8-32"),
        seed=seed,
        image_seed=image_seed,
    )
    spec = RunSpec(
        url=url, model=model, duration_s=duration, rate=rate, seed=seed, trace=False, timeout_s=60, api_key=KEY
    )
    records, seconds = asyncio.run(run(spec, workload, progress=None))
    return summarize(records, seconds, SLO_MIXED), records


def sweep(
    url: str,
    model: str,
    duration: float,
    min_requests: int = MIN_REQUESTS,
    rates: tuple[float, ...] = RATES,
    also: tuple[float, ...] = (),
) -> dict[float, Run]:
    """The mixed load at the rates :func:`loadtest.sweep.next_rate` picks from ``rates``, in its order. Every rate
    sends one sequence — the same arrivals (time-scaled) and requests — with images of its own (the seed of its index
    in ``rates``), the same for every server: a higher rate is more of the same load, not a different draw of it.
    ``also``: rates to run besides the climb (:func:`loadtest.sweep.next_rate`)."""
    out: dict[float, Run] = {}

    def points() -> list[tuple[float, float | None, float]]:
        return [(r, s["slo_attainment"], s["goodput_rps"]) for r, (s, _) in out.items()]

    while (rate := next_rate(points(), rates, also=also)) is not None:
        images = seed_of("sweep") + rates.index(rate)
        out[rate] = mixed(url, model, rate, run_seconds(rate, duration, min_requests), SWEEP_SEQUENCE, images)
    return out


def sweep_row(rate: float, run_: Run) -> dict[str, Any]:
    summary, records = run_
    return {
        "rate_rps": rate,
        "goodput_rps": round(summary["goodput_rps"], 3),
        "slo_attainment": summary["slo_attainment"],
        "ttft_p95_s": summary["ttft_s"]["p95"],
        **outcome_counts(records),
    }


def curve(sweep: dict[float, Run]) -> dict[str, Any]:
    """One server's goodput curve: its rows at the rates it ran, its capacity, knee and peak goodput
    (:mod:`loadtest.sweep`)."""
    rows = [sweep_row(rate, sweep[rate]) for rate in sorted(sweep)]
    top = peak([(r["rate_rps"], r["goodput_rps"]) for r in rows])
    ran = [(r["rate_rps"], r["slo_attainment"], r["goodput_rps"]) for r in rows]
    attainment = [(r["rate_rps"], r["slo_attainment"]) for r in rows]
    return {
        "capacity_rps": capacity(attainment),
        "knee_rps": knee(attainment),
        "peak_goodput_rps": top[1] if top else None,
        "peak_at_rps": top[0] if top else None,
        "peak_located": peak_located(ran),
        "sweep": rows,
    }


def stages(records: list[RequestRecord]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in summarize(records, 1.0, SLO())["stage_ms_mean"].items()}
