"""Goodput against offered load: where each server falls over, and how much it carries at most.

A server *keeps up* at an offered rate while at least :data:`KEEP_UP` of the requests it was sent meet the SLOs
(its SLO attainment — judged on the requests actually sent, since a Poisson run of a nominal rate sends more or fewer
than rate × duration). Its **knee** is the first rate of an ascending sweep at which it no longer keeps up, its
**capacity** the last rate before the knee, and its **peak goodput** the most goodput it delivered at any swept rate
(:func:`peak`). ``make bench`` sweeps every server over the same ascending :data:`RATES` — one step apart, fine enough
to place both the capacity and the peak of servers of this size on these machines — and stops a server's sweep once it
is past its peak (:func:`past_peak`: no longer keeping up, and delivering less than at an earlier rate; overload only
loses more from there). Each run lasts long enough to send about :data:`MIN_REQUESTS` requests
(:func:`run_seconds`).
"""

from __future__ import annotations

from collections.abc import Sequence

KEEP_UP = 0.9
RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
"""The offered rates (requests/s) every server is swept at, ascending, until it is past its peak."""
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


def run_seconds(rate: float, duration: float, min_requests: int = MIN_REQUESTS) -> float:
    """A run's length at ``rate``: ``duration``, or longer where that would send fewer than ``min_requests``."""
    return max(duration, min_requests / rate)
