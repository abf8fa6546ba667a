"""Goodput against offered load: where each server falls over, and how much it carries at most.

A server *keeps up* at an offered rate while at least :data:`KEEP_UP` of the requests it was sent meet the SLOs
(its SLO attainment — judged on the requests actually sent, since a Poisson run of a nominal rate sends more or fewer
than rate × duration). Its **knee** is the first rate of an ascending sweep at which it no longer keeps up, its
**capacity** the last rate before the knee, and its **peak goodput** the most goodput it delivered at any swept rate
(:func:`peak`), *located* when a higher rate ran and delivered less (:func:`peak_located`; a peak at the top of what
ran says only that the server carries at least that much). ``make bench`` sweeps every server over the same
:data:`RATES` — one step apart, fine enough to place both the capacity and the peak of servers of this size on these
machines — in the order :func:`next_rate` gives: from :data:`START` down one rate at a time while the lowest run
does not keep up (its capacity lies below), then up until the server is past its peak (:func:`past_peak`: no longer
keeping up, and delivering less than at a lower rate; overload only loses more from there) — a server that is behind
at :data:`START` and delivered less there than below is past its peak already and climbs no higher — then any rate
the caller also wants (the naive server's knee, where each server's goodput is also reported). Each run lasts long
enough to send about :data:`MIN_REQUESTS` requests (:func:`run_seconds`), and every rate sends one sequence of
requests (:func:`loadtest.bench_loads.sweep`).
"""

from __future__ import annotations

from collections.abc import Sequence

KEEP_UP = 0.9
RATES = tuple(float(rate) for rate in range(1, 11))
"""The offered rates (requests/s) a server may be swept at (:func:`next_rate` says which, in which order)."""
START = 5.0
"""Where a sweep starts. A rate below it runs only where the server does not keep up at it: one that keeps up at
:data:`START` delivers about that much goodput there, more than any lower rate can, and keeps up below, so a lower run
would place neither its capacity nor its peak. In the run of 2026-12-05 (Zen 4) every Prism topology and the monolith
kept up at 5 rps and peaked at 6–8; in that of 2026-12-07 (Zen 2) most fell behind at 5 and peaked at 4."""
MIN_REQUESTS = 20


def keeps_up(attainment: float | None, fraction: float = KEEP_UP) -> bool:
    return attainment is not None and attainment >= fraction


def knee(points: Sequence[tuple[float, float | None]], fraction: float = KEEP_UP) -> float | None:
    """The first offered rate (ascending) at which the SLO attainment falls below ``fraction``; ``None`` if it never
    does. ``points``: (rate, attainment)."""
    for rate, attainment in sorted(points):
        if not keeps_up(attainment, fraction):
            return rate
    return None


def capacity(points: Sequence[tuple[float, float | None]], fraction: float = KEEP_UP) -> float | None:
    """The highest rate below the knee (every rate if there is no knee); ``None`` when even the lowest fails."""
    ordered = sorted(points)
    k = knee(ordered, fraction)
    kept = [rate for rate, _ in ordered if k is None or rate < k]
    return kept[-1] if kept else None


def peak(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(rate, goodput) of the most goodput over ``points`` (rate, goodput) — the lowest such rate on a tie; ``None``
    for no points."""
    return max(sorted(points), key=lambda p: p[1]) if points else None


def past_peak(points: Sequence[tuple[float, float | None, float]]) -> bool:
    """Whether the last of ``points`` (rate, attainment, goodput; ascending) is past the server's peak: it no longer
    keeps up and delivers less than an earlier rate did — higher rates would only show the collapse again."""
    if len(points) < 2:
        return False
    *earlier, (_, attainment, goodput) = points
    return not keeps_up(attainment) and goodput < max(g for _, _, g in earlier)


def peak_located(points: Sequence[tuple[float, float | None, float]]) -> bool:
    """Whether ``points`` (rate, attainment, goodput) place their peak (:func:`peak`): a higher rate ran, and the
    climb was past the peak there (:func:`past_peak`)."""
    top = peak([(rate, goodput) for rate, _, goodput in points])
    if top is None:
        return False
    ran = sorted(points)
    return any(p[0] > top[0] and past_peak(ran[: i + 1]) for i, p in enumerate(ran))


def next_rate(
    points: Sequence[tuple[float, float | None, float]],
    rates: Sequence[float] = RATES,
    start: float = START,
    also: Sequence[float] = (),
) -> float | None:
    """The rate to run next, given the runs so far (rate, attainment, goodput; any order); ``None``: the sweep is
    done. From ``start`` (the lowest of ``rates`` if it is not one of them): down through ``rates``, one at a time,
    while the lowest run does not keep up; then up until the top rate has run or the highest run is past the peak of
    all those below it; then each of ``also`` (those of ``rates``) that has not run. The descent comes first because a
    server behind at ``start`` is often past its peak there already: the runs below place its peak, and a climb would
    only show the collapse again (one run of each sweep on the machines where servers peak below ``start``)."""
    ordered = sorted(rates)
    first = start if start in ordered else ordered[0]
    by_rate = {p[0]: p for p in points}
    if first not in by_rate:
        return first
    # The descent and the climb are the runs next to each other from ``first`` down and up: a rate run only as one of
    # ``also``, past a gap, joins them when they reach it (so neither skips the rates next to ``first``).
    at = ordered.index(first)
    climb = _run_from(ordered[at:], by_rate)
    descent = _run_from(ordered[:at][::-1], by_rate)
    lowest = descent[-1] if descent else climb[0]
    if lowest[0] != ordered[0] and not keeps_up(lowest[1]):
        return ordered[ordered.index(lowest[0]) - 1]
    if not past_peak([*descent[::-1], *climb]) and climb[-1][0] != ordered[-1]:
        return ordered[at + len(climb)]
    wanted = [r for r in also if r in ordered and r not in by_rate]
    return wanted[0] if wanted else None


def _run_from(rates: Sequence[float], by_rate: dict) -> list:
    """The points of ``rates``, in their order, up to the first that has not run."""
    out = []
    for rate in rates:
        if rate not in by_rate:
            break
        out.append(by_rate[rate])
    return out


def run_seconds(rate: float, duration: float, min_requests: int = MIN_REQUESTS) -> float:
    """A run's length at ``rate``: ``duration``, or longer where that would send fewer than ``min_requests``."""
    return max(duration, min_requests / rate)
