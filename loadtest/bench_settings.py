"""What a full ``make bench`` run and a ``--quick`` one differ in; the figures' run counts are
:func:`loadtest.figures.runs`'."""

from __future__ import annotations

from loadtest import bench_ucx, figures
from loadtest.sweep import MIN_REQUESTS

SWEEP_SECONDS = 16.0
"""A sweep run's length (shorter than the other loads' 20 s): one sequence at every rate, a sweep from 5 rps down and up
(:func:`loadtest.sweep.next_rate`) and the 35-minute budget. At 5–9 rps it sends 75–135 requests; overload shows in it
as TTFTs past the 2-s SLO once the backlog exceeds two seconds of work, which at one request a second over capacity
takes about 12 s."""


class Settings:
    def __init__(self, quick: bool, duration: float | None) -> None:
        self.quick = quick
        self.duration = duration if duration is not None else (8.0 if quick else 20.0)
        """Seconds per load run."""
        self.sweep_duration = min(self.duration, SWEEP_SECONDS)
        """Seconds per run of the goodput sweep (at least :data:`MIN_REQUESTS` requests each)."""
        self.min_requests = 8 if quick else MIN_REQUESTS
        """Requests each point of the goodput sweep sends at least."""
        self.decode_tokens = 16 if quick else 32
        self.ucx_transports = {"default": None} if quick else bench_ucx.TRANSPORTS
        self.hop_requests = 8 if quick else 20
        """Sequential requests of each kind behind the per-hop report (:mod:`loadtest.bench_hops`)."""

    def runs(self, name: str) -> int:
        return figures.runs(name, self.quick)
