"""Per-stage autoscaling on the stage's own queue depth.

Each deployment reports ``queue_depth`` in its own unit through ``record_autoscaling_stats`` (media: items in
flight; encode: pending vision patches; prefill: prompt tokens still to compute; decode: running + waiting sequences).
:class:`QueueDepthPolicy` wants ``ceil(total_depth / target_per_replica)`` replicas, clamped to the stage's range;
it scales up at once and down only after the lower target has held for ``downscale_delay_s`` (no flapping) — lower
than its last decision, so a replica still starting is not stopped by the next tick's wish — and never while a
replica it asked for is still starting (for up to :data:`STARTING_GRACE_S`): the delay counts from when they run.
Decode also reports ``kv_used_fraction``: above ``kv_high_watermark`` on average it asks for one more replica even if
the sequence count alone would not. Each decision is exported as ``prism_autoscale_desired_replicas`` (recorded in
the Serve controller, where the policy runs) so dashboards can show wanted vs running replicas next to the queue: one
series per stage the deployment holds (a grouped topology's deployment holds several: :func:`stages_of`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

Report = Callable[[Any, int], None]
STARTING_GRACE_S = 60.0
"""How long a downscale waits for the replicas of the last decision to be running. A depth near the target swings
across it within seconds (a decode replica's sequences come and go between prefills); with a short delay the policy
stopped each new replica while it loaded its model — the e2e test's 2 s delay, 4 clients at a target of 2 on a loaded
2-core host: five starts stopped in 70 s, none running. Bounded: a replica that cannot be placed is not held for
ever."""


class QueueDepthPolicy:
    def __init__(
        self,
        target_per_replica: float,
        downscale_delay_s: float = 10.0,
        kv_high_watermark: float = 0.85,
        report: Report | None = None,
    ) -> None:
        self.target = target_per_replica
        self.downscale_delay_s = downscale_delay_s
        self.kv_high = kv_high_watermark
        self.report = report or _report_gauge

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision, state = self._decide(ctx)
        self.report(ctx, decision)
        return decision, state

    def _decide(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        depth = sum(metrics.get("queue_depth", {}).values())
        want = math.ceil(depth / self.target) if depth > 0 else 0
        kv = list(metrics.get("kv_used_fraction", {}).values())
        if kv and sum(kv) / len(kv) > self.kv_high:
            want = max(want, ctx.current_num_replicas + 1)
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        want = max(low, min(high, want))
        state = dict(ctx.policy_state or {})
        now = ctx.current_time or 0.0
        # Downscaling is measured against the last decision, not the replicas running: a replica still starting
        # counts (against the running ones, the next tick's lower wish stopped it while it loaded its model — Serve
        # added and removed one four times in 5 s under a steady 3-stream load, each start costing the cores)
        held = max(low, min(high, _last_decision(ctx)))  # (within the range as it is now)
        if want >= held:
            state.pop("below_since", None)
            state.pop("starting_since", None)
            return want, state
        if ctx.current_num_replicas < held and now - state.setdefault("starting_since", now) < STARTING_GRACE_S:
            state.pop("below_since", None)  # (the delay starts once they run)
            return held, state
        if ctx.current_num_replicas >= held:
            state.pop("starting_since", None)
        since = state.setdefault("below_since", now)
        if now - since >= self.downscale_delay_s:
            state.pop("below_since", None)
            return want, state
        return held, state


def _last_decision(ctx: Any) -> int:
    """The replicas Serve is bringing the deployment to (its target: the last decision), else those running."""
    target = getattr(ctx, "target_num_replicas", None)
    return ctx.current_num_replicas if target is None else int(target)


_gauge: Any = None


def _report_gauge(ctx: Any, replicas: int) -> None:
    global _gauge
    if _gauge is None:
        from ray.util.metrics import Gauge

        from common.obs.catalogue import BY_NAME

        spec = BY_NAME["prism_autoscale_desired_replicas"]
        _gauge = Gauge(spec.name, description=spec.description, tag_keys=spec.tags)
    name = str(ctx.deployment_name)
    for stage in stages_of(name):
        _gauge.set(replicas, tags={"application": str(ctx.app_name or ""), "deployment": name, "stage": stage})


def stages_of(deployment: str) -> list[str]:
    """The stages a deployment holds, from its name (:mod:`services.app`: the group's stages capitalised and joined,
    then ``-<model>`` in a multi-model app): ``Decode-prism-small-llava`` → ``["decode"]``, ``EncodePrefillDecode`` →
    ``["encode", "prefill", "decode"]``. A group's decision is each of its stages' (the dashboards' rows are per
    stage, and each stage of the group counts the group's replicas)."""
    return [part.lower() for part in re.findall(r"[A-Z][a-z]*", deployment.split("-", 1)[0])] or [deployment.lower()]
