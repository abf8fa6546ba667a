"""What a full ``make bench`` run and a ``--quick`` one differ in; the figures' run counts are
:func:`loadtest.figures.runs`'."""

from __future__ import annotations

from loadtest import bench_ucx, figures
from loadtest.sweep import MIN_REQUESTS


class Settings:
    def __init__(self, quick: bool, duration: float | None) -> None:
        self.quick = quick
        self.duration = duration if duration is not None else (8.0 if quick else 20.0)
        """Seconds per load run."""
        self.min_requests = 8 if quick else MIN_REQUESTS
        """Requests each point of the goodput sweep sends at least."""
        self.decode_tokens = 16 if quick else 32
        self.ucx_transports = {"default": None} if quick else bench_ucx.TRANSPORTS
        self.hop_requests = 8 if quick else 20
        """Sequential requests of each kind behind the per-hop report (:mod:`loadtest.bench_hops`)."""

    def runs(self, name: str) -> int:
        return figures.runs(name, self.quick)
