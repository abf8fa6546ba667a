"""``make bench``'s server sessions: each server started once, on this machine, one at a time (they never share the
cores), and every load behind the serving figures run against it — returned raw, turned into figures by
:mod:`loadtest.bench_results`.

Order: the naive server, Prism, Prism's cache-reach application (:mod:`loadtest.bench_cache`), the monolith. Within a
session the runs of different figures are interleaved — run i of each, then run i + 1 — each with seeds, and so images,
of its own (:data:`loadtest.bench_loads.SEEDS`): a slow spell of the machine lands on one run of several figures rather
than on every run of one, and a cold cache stays cold. A ratio's run i pairs the two servers' i-th runs (not two runs at
the same moment). Every server — the naive one too — first answers a few warm-up requests, so first-request costs stay
out of the figures. Each server's goodput sweep runs the same rates (:data:`loadtest.sweep.RATES`) and the same
sequence of requests at each (:func:`loadtest.bench_loads.sweep`), in the order :func:`loadtest.sweep.next_rate`
gives: from :data:`loadtest.sweep.START` down while it does not keep up, then up until it is past its peak;
Prism's and the monolith's sweeps also run the naive server's knee (``also``: the goodput there stays in the raw).
In a run, the two tenant figures take the text flood figure's idle probes as their own (idle, the key that sends a
probe changes nothing; sending them again cost 20 s a run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest import bench_cache, bench_hops
from loadtest import bench_loads as loads
from loadtest import bench_servers as servers
from loadtest.bench_loads import Flood, seed_of
from loadtest.bench_settings import Settings
from loadtest.stats import RequestRecord

Say = Callable[[str], None]


@dataclass
class ServerRuns:
    """One server's runs of the serving figures (the monolith runs no tenant figure)."""

    cold: list[list[RequestRecord]] = field(default_factory=list)
    """Light load of medium images (the p50 TTFT figure), one list per run."""
    floods: list[Flood] = field(default_factory=list)
    """Text probes idle / under one tenant's large-image flood."""
    tenants: list[Flood] = field(default_factory=list)
    """Tenant beta's text probes idle / under tenant alpha's flood."""
    tenants3: list[Flood] = field(default_factory=list)
    """Tenant beta's text probes under alpha's and gamma's floods at once (idle: the same run's ``tenants``)."""
    sweep: dict[float, Any] = field(default_factory=dict)
    """The goodput sweep: rate → (summary, records), the rates it ran (:func:`loadtest.bench_loads.sweep`)."""
    hops: dict[str, Any] = field(default_factory=dict)
    """The per-hop fixed costs from the server's traces (:mod:`loadtest.bench_hops`), measured first."""


def warm_up(url: str, model: str) -> None:
    loads.load(url, model, loads.medium("cold", seed_of("warm_up")), 1.0, 4.0, seed=seed_of("warm_up"))


def naive_session(model: str, st: Settings, say: Say) -> ServerRuns:
    """The naive server runs the goodput sweep only (it has no traces, tenants or caches to measure)."""
    with servers.subprocess_server("loadtest.servers.naive", ["--model", model]) as url:
        warm_up(url, model)
        say("naive: the goodput sweep")
        return ServerRuns(sweep=loads.sweep(url, model, st.sweep_duration, st.min_requests))


def light(url: str, model: str, st: Settings, i: int) -> list[RequestRecord]:
    s = seed_of("cold", i)
    return loads.load(url, model, loads.medium("cold", s), 0.5, st.duration, seed=s)


def prism_session(
    config: dict[str, Any], model: str, st: Settings, say: Say, also: tuple[float, ...] = ()
) -> ServerRuns:
    out = ServerRuns()
    n_ttft, n_flood = st.runs("ttft_ratio_epd_vs_monolith"), st.runs("text_ttft_p95_flood_vs_idle")
    n_tenant = st.runs("tenant_ttft_p95_flood_vs_idle")
    with servers.prism_app(config) as url:
        warm_up(url, model)
        say("Prism: the fixed cost of each hop (sequential traced requests, text-only and one small image)")
        out.hops = bench_hops.hop_costs(url, model, st.hop_requests, api_key=servers.KEY)
        for i in range(max(n_ttft, n_flood, n_tenant)):
            say(f"Prism, run {i + 1}: light load of medium images; text probes idle / under a flood")
            if i < n_ttft:
                out.cold.append(light(url, model, st, i))
            if i < n_flood:
                out.floods.append(loads.flood(url, model, st.duration, seed_of("flood", i)))
            if i < n_tenant:
                say(f"Prism, run {i + 1}: tenant beta's text probes idle / under tenant alpha's large-image flood")
                keys = {"flood_key": servers.ALPHA, "probe_key": servers.BETA}
                idle = out.floods[i].idle if i < n_flood else None
                out.tenants.append(loads.flood(url, model, st.duration, seed_of("tenant_flood", i), **keys, idle=idle))
                say(f"Prism, run {i + 1}: tenant beta's text probes under alpha's and gamma's floods at once")
                base, idle = seed_of("tenants3_flood", i), out.tenants[-1].idle
                out.tenants3.append(
                    loads.flood(url, model, st.duration, base, **keys, also_flooding=(servers.GAMMA,), idle=idle)
                )
        say("Prism: the goodput sweep")
        out.sweep = loads.sweep(url, model, st.sweep_duration, st.min_requests, also=also)
    return out


def cache_session(config: dict[str, Any], model: str, st: Settings, say: Say) -> tuple[list, list]:
    """The cache-reach runs (cold loads, hot loads) in an application of their own (:mod:`loadtest.bench_cache`)."""
    with servers.prism_app(bench_cache.app_config(config, model)) as url:
        warm_up(url, model)
        return bench_cache.measure(url, model, st.runs("encoder_cache_hot_cold_ttft_ratio"), st.duration, say)


def monolith_session(
    config: dict[str, Any], model: str, st: Settings, say: Say, also: tuple[float, ...] = ()
) -> ServerRuns:
    out = ServerRuns()
    n_ttft, n_flood = st.runs("ttft_ratio_epd_vs_monolith"), st.runs("text_ttft_p95_flood_vs_idle")
    with servers.subprocess_server("loadtest.servers.monolith", ["--config", servers.write_config(config)]) as url:
        warm_up(url, model)
        say("monolith: the same spans with every hop in process")
        out.hops = bench_hops.hop_costs(url, model, st.hop_requests, api_key=servers.KEY)
        for i in range(max(n_ttft, n_flood)):
            say(f"monolith, run {i + 1}: light load, medium images; text probes idle / flood")
            if i < n_ttft:
                out.cold.append(light(url, model, st, i))
            if i < n_flood:
                out.floods.append(loads.flood(url, model, st.duration, seed_of("flood", i)))
        say("monolith: the goodput sweep")
        out.sweep = loads.sweep(url, model, st.sweep_duration, st.min_requests, also=also)
    return out
