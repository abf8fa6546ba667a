"""The queue-depth policy: scale up at once, down only after the delay, KV pressure adds a replica."""

from __future__ import annotations

from types import SimpleNamespace

from services.platform.autoscaling import QueueDepthPolicy


def ctx(depth, current, now, state=None, kv=None, low=1, high=4, target=None):
    metrics = {"queue_depth": {f"r{i}": depth / max(1, current) for i in range(max(1, current))}}
    if kv is not None:
        metrics["kv_used_fraction"] = {"r0": kv}
    return SimpleNamespace(
        aggregated_metrics=metrics,
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high,
        policy_state=state or {},
        current_time=now,
        deployment_name="Encode",
        app_name="prism",
    )


def test_scales_up_immediately_and_clamps():
    policy = QueueDepthPolicy(target_per_replica=4, downscale_delay_s=10)
    assert policy(ctx(9, 1, 0.0))[0] == 3
    assert policy(ctx(100, 1, 0.0))[0] == 4
    assert policy(ctx(0, 1, 0.0))[0] == 1


def test_scales_down_only_after_the_delay():
    policy = QueueDepthPolicy(target_per_replica=4, downscale_delay_s=10)
    want, state = policy(ctx(0, 3, 100.0))
    assert want == 3 and state["below_since"] == 100.0
    want, state = policy(ctx(0, 3, 105.0, state))
    assert want == 3
    want, state = policy(ctx(0, 3, 110.5, state))
    assert want == 1 and "below_since" not in state
    _, state = policy(ctx(0, 3, 200.0))
    want, state = policy(ctx(12, 3, 201.0, state))  # load came back: the pending downscale is forgotten
    assert want == 3 and "below_since" not in state


def test_kv_pressure_adds_a_replica():
    policy = QueueDepthPolicy(target_per_replica=100, kv_high_watermark=0.8)
    assert policy(ctx(1, 1, 0.0, kv=0.95))[0] == 2
    assert policy(ctx(1, 1, 0.0, kv=0.5))[0] == 1


def test_every_decision_is_reported_for_the_dashboards():
    seen = []
    policy = QueueDepthPolicy(target_per_replica=4, downscale_delay_s=10, report=lambda c, n: seen.append(n))
    decisions = [policy(ctx(d, 1, 0.0))[0] for d in (9, 100, 0)]
    assert seen == decisions == [3, 4, 1]


def test_each_decision_is_labelled_with_the_stages_its_deployment_holds():
    """The dashboards' rows select ``stage="decode"`` (and so on): a model-suffixed name, or a group's, must still
    land in them — a group's decision in the row of each stage it holds."""
    from services.platform.autoscaling import stages_of

    assert stages_of("Decode") == ["decode"]
    assert stages_of("Decode-prism-small-llava") == ["decode"]
    assert stages_of("Media-prism-tiny-qwen2vl") == ["media"]
    assert stages_of("EncodePrefillDecode-prism-tiny-llava") == ["encode", "prefill", "decode"]
    assert stages_of("PrefillDecode") == ["prefill", "decode"]


def test_a_replica_still_starting_is_not_stopped_by_the_next_ticks_wish():
    """One running, a second starting (Serve's target 2): a tick whose depth wants one holds two while it starts, past
    the delay; the delay counts from when both run."""
    from services.platform.autoscaling import STARTING_GRACE_S

    policy = QueueDepthPolicy(target_per_replica=4, downscale_delay_s=2)
    want, state = policy(ctx(4, 1, 100.0, target=2))
    assert want == 2 and "below_since" not in state
    want, state = policy(ctx(4, 1, 115.0, state, target=2))  # still loading its model, 15 s on: held
    assert want == 2 and "below_since" not in state
    want, state = policy(ctx(4, 2, 120.0, state))  # running: now the delay starts
    assert want == 2 and state["below_since"] == 120.0 and "starting_since" not in state
    want, state = policy(ctx(4, 2, 122.5, state))
    assert want == 1
    assert policy(ctx(9, 1, 0.0, target=2))[0] == 3  # (up at once, as ever)
    # a replica that never starts (no room for it) is held for the grace, then the delay applies as before
    want, state = policy(ctx(4, 1, 0.0, target=2))
    want, state = policy(ctx(4, 1, STARTING_GRACE_S, state, target=2))
    assert want == 2 and state["below_since"] == STARTING_GRACE_S
    want, state = policy(ctx(4, 1, STARTING_GRACE_S + 2.5, state, target=2))
    assert want == 1
