"""make chaos's outcome arithmetic (loadtest.chaos), without killing anything."""

from __future__ import annotations

import pytest

from common.config.topology import deployment_names
from loadtest.chaos import STAGES, Outcome, app_config, longest_gap, summarize


def test_the_longest_gap_counts_only_completed_requests_and_the_edges():
    done = [Outcome(0, t, 200, False, "length") for t in (1.0, 2.0, 6.5)]
    failed = Outcome(0, 4.0, 503, True, None, "stage_unavailable")
    assert longest_gap([*done, failed], 0.0, 8.0) == 4.5  # 2.0 → 6.5: the failure does not close the gap
    assert longest_gap([], 0.0, 3.0) == 3.0


def test_failures_are_attributed_to_the_last_kill_before_them():
    kills = [("Media", 10.0), ("Decode", 20.0)]
    outcomes = [
        Outcome(0, 5.0, 200, True, "stop"),
        Outcome(9, 12.0, 503, False),
        Outcome(19, 21.0, 200, True, None, "decode failed"),  # a stream that ended without a finish reason
        Outcome(20, 22.0, 200, False, "length", "", [{"after_tokens": 7, "ms": 812.5, "cause": "ActorDiedError"}]),
    ]
    s = summarize(outcomes, kills, 0.0, 30.0)
    assert (s["requests"], s["complete"], s["streams"], s["streams_complete"]) == (4, 2, 2, 1)
    assert s["by_status"] == {"200": 3, "503": 1}
    assert s["failed_after_kill_of"] == {"Media": 1, "Decode": 1}
    assert s["longest_gap_s"] == 17.0 and [k["stage"] for k in s["kills"]] == ["Media", "Decode"]
    assert s["migrated"] == {"requests": 1, "complete": 1, "tokens_replayed": 7, "longest_resume_ms": 812.5}


@pytest.mark.parametrize("topology", ["E/P/D", "E/PD", "EP/D", "EPD", "ME/P/D", "ME/PD", "MEPD"])
def test_two_replicas_of_every_deployment_fit_the_cpus(topology):
    """Built as Serve would deploy it: two replicas of each deployment of the topology, CPU shares under 2."""
    from services.app import build_app
    from tests.unit.services.test_ray_configs import _deployments, _replicas

    config = app_config("prism-tiny-llava", topology=topology)
    assert all(config["deployments"][s.lower()]["min_replicas"] == 2 for s in STAGES)
    built = {d.name: d for d in _deployments(build_app({"config": config}))}
    assert set(built) == {"Ingress", *deployment_names(topology)}
    assert all(_replicas(d) == (2, 2) for name, d in built.items() if name != "Ingress")
    assert sum(d.ray_actor_options["num_cpus"] * _replicas(d)[0] for d in built.values()) < 2


def test_the_decode_victim_is_a_replica_with_a_sequence_that_still_has_tokens_to_go():
    from loadtest.chaos import VICTIM_TOKENS_LEFT, pick_decode_victim

    rounds = iter(
        [
            [],  # every call failed (a replica just replaced): asked again
            [
                {"pid": 11, "running": 0, "most_tokens_left": 0},  # idle
                {"pid": 12, "running": 1, "most_tokens_left": VICTIM_TOKENS_LEFT - 1},  # about to finish
                {"pid": 99, "running": 3, "most_tokens_left": 40},  # not one of the deployment's replicas
            ],
            [{"pid": 11, "running": 0, "most_tokens_left": 0}, {"pid": 12, "running": 2, "most_tokens_left": 9}],
        ]
    )
    now, bounds = [0.0], []

    def ask(seconds: float) -> list[dict]:
        bounds.append(seconds)
        return next(rounds)

    assert pick_decode_victim(ask, [11, 12], clock=lambda: now[0], pause=lambda s: None) == 12
    assert bounds == [10.0] * 3  # (each call bounded by the time left, at most 10 s)

    def idle(seconds: float) -> list[dict]:
        bounds.append(seconds)
        now[0] += 2.0
        return [{"pid": 11, "running": 0, "most_tokens_left": 0}]

    now[0], bounds = 0.0, []
    assert pick_decode_victim(idle, [11, 12], timeout=5.0, clock=lambda: now[0], pause=lambda s: None) is None
    assert bounds == [5.0, 3.0, 1.0]  # asked until the timeout, each round within what was left, then none
