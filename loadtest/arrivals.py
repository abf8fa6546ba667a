"""Open-loop arrival processes: when each request is *sent*, decided before the run and independent of responses.

``poisson``: exponential gaps at ``rate`` requests/s. ``gamma``: gamma gaps with the same mean and a coefficient of
variation ``cv`` (burstiness: cv > 1 clusters arrivals, cv = 1 is Poisson, cv < 1 is more regular). A closed loop
(``fixed concurrency``) is not an arrival process: :mod:`loadtest.runner` runs it with N workers instead.
"""

from __future__ import annotations

import random
from typing import Literal

Process = Literal["poisson", "gamma"]


def arrival_times(process: Process, rate: float, duration_s: float, seed: int = 0, cv: float = 1.0) -> list[float]:
    """Send times (seconds from the start) within ``duration_s``."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    if process == "gamma" and cv <= 0:
        raise ValueError("cv must be positive")
    rng = random.Random(seed)
    times, t = [], 0.0
    while True:
        if process == "poisson":
            gap = rng.expovariate(rate)
        else:  # gamma with mean 1/rate and std cv/rate: shape k = 1/cv², scale = cv²/rate
            shape = 1.0 / (cv * cv)
            gap = rng.gammavariate(shape, 1.0 / (rate * shape))
        t += gap
        if t >= duration_s:
            return times
        times.append(t)
