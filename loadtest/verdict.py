"""Whether a benchmark figure counts: met, missed, or invalid.

A ratio is only as good as both of its sides. A figure is ``invalid`` — never ``met`` — when any side it was computed
from sent no requests, had more than :data:`MAX_ERROR_FRACTION` of them fail (errors and timeouts: the percentiles
then describe only the survivors), produced zero goodput (a ratio against zero is not a win), or when the value itself
is not a finite number. Otherwise it is ``met`` or ``missed`` against its target. The reason travels with the figure
into ``summary.json`` and the table in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from typing import Any

MAX_ERROR_FRACTION = 0.01


def judge(
    value: float | None,
    op: str,
    target: float,
    sides: dict[str, dict[str, Any]] | None = None,
    goodput: dict[str, float] | None = None,
) -> tuple[str, str]:
    """``(status, reason)``: status ``met`` | ``missed`` | ``invalid``; ``sides`` maps a side's name to its
    :func:`loadtest.stats.outcome_counts`, ``goodput`` a side's name to its goodput (requests/s)."""
    for side, counts in (sides or {}).items():
        if not counts.get("requests"):
            return "invalid", f"{side} sent no requests"
        errors, total = counts.get("errors", 0), counts["requests"]
        if errors / total > MAX_ERROR_FRACTION:
            return "invalid", f"{side}: {errors} of {total} requests failed (more than {MAX_ERROR_FRACTION:.0%})"
    for side, rps in (goodput or {}).items():
        if not rps:
            return "invalid", f"{side} goodput is 0"
    if value is None or not math.isfinite(value):
        return "invalid", "no finite value"
    met = value <= target if op == "<=" else value >= target
    return ("met" if met else "missed"), ""
