"""Goodput against offered load: where a server falls over, and the rates to sweep around it.

A server *keeps up* at an offered rate while at least :data:`KEEP_UP` of the requests it was sent meet the SLOs
(its SLO attainment — judged on the requests actually sent, since a Poisson run of a nominal rate sends more or fewer
than rate × duration). Its **knee** is the first rate of an ascending sweep at which it no longer keeps up, and its
**capacity** the last rate before the knee. ``make bench`` finds the naive server's capacity with a ramp
(:data:`RAMP`), sweeps every server at multiples of it (:data:`MULTIPLIERS`), and compares goodputs at the naive
server's knee — the first load it cannot carry — where a better server should still deliver. Each run lasts long
enough to send about :data:`MIN_REQUESTS` requests (:func:`run_seconds`).
"""

from __future__ import annotations

from collections.abc import Sequence

KEEP_UP = 0.9
RAMP = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Offered rates (requests/s) tried in order to find the naive server's capacity; the ramp stops at its knee."""
MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)
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


def sweep_rates(base: float, multipliers: Sequence[float] = MULTIPLIERS) -> list[float]:
    """The rates to sweep every server at: multiples of the naive server's capacity (rounded to 0.01 rps)."""
    return sorted({round(base * m, 2) for m in multipliers if base * m > 0})


def run_seconds(rate: float, duration: float, min_requests: int = MIN_REQUESTS) -> float:
    """A run's length at ``rate``: ``duration``, or longer where that would send fewer than ``min_requests``."""
    return max(duration, min_requests / rate)
