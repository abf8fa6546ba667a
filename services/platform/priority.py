"""The OS priority Prism's Ray workers start at, set in the environment of every ``ray start`` Prism makes.

Ray starts its worker processes at niceness 15 (``RAY_worker_niceness``) so that its own daemons keep the cores.
A stage lowers the priority of its throughput work further — media decoding, the vision tower (``cpu_nice``
18–19, :mod:`services.stages.threads`; long prefills too where ``long_lane_nice`` says so) — so that where stages
share cores a flood of large images cannot take them from the latency path (the proxy, the ingress, prefills,
decode steps). From 15, that is
almost no difference: CFS weighs niceness 15 at 36 and 19 at 15, so the latency path got ~2× the throughput work's
share of a contended core. Measured with ``make serve``'s config, two API keys and no quota, 48 clients sending
1920×1440 JPEGs: the other tenant's text TTFT p95 went from 38 ms idle to 803 ms (21×). Started at 0, the
latency path weighs 1024 against 15–18 (~60×): the same flood left it at 4.3–5.7× idle over four runs (171 ms in
the first), the flood's own goodput unchanged (9.4–10.7 vs 10.2–11.6 requests/s).

Only worker processes are affected (the raylet and GCS start at 0 either way). The variable has to be in the
environment of the raylet — ``ray start`` or ``ray.init`` starting a local cluster — not of a driver.
"""

from __future__ import annotations

ENV_WORKER_NICENESS = "RAY_worker_niceness"
WORKER_NICENESS = 0


def worker_env() -> dict[str, str]:
    """What ``ray start`` needs in its environment for Prism's workers to start at :data:`WORKER_NICENESS`."""
    return {ENV_WORKER_NICENESS: str(WORKER_NICENESS)}
