"""The goodput sweep's knee finder: where a server stops keeping up with the offered rate."""

from __future__ import annotations

from loadtest.sweep import capacity, keeps_up, knee, run_seconds, sweep_rates


def test_the_knee_is_the_first_rate_the_server_cannot_carry():
    points = [(2.0, 0.37), (0.5, 1.0), (1.0, 0.95), (4.0, 0.2)]  # (rate, SLO attainment), unordered on purpose
    assert knee(points) == 2.0 and capacity(points) == 1.0
    assert keeps_up(0.9) and not keeps_up(0.89) and not keeps_up(None)  # None: nothing was sent


def test_a_server_that_keeps_up_everywhere_has_no_knee_and_the_top_rate_as_capacity():
    points = [(0.5, 1.0), (1.0, 1.0), (2.0, 0.92)]
    assert knee(points) is None and capacity(points) == 2.0


def test_a_server_that_fails_the_lowest_rate_has_no_capacity():
    points = [(0.5, 0.1), (1.0, 0.95)]  # a later recovery does not move the knee back
    assert knee(points) == 0.5 and capacity(points) is None
    assert knee([]) is None and capacity([]) is None


def test_the_sweep_brackets_the_naive_capacity_and_each_run_sends_enough_requests():
    assert sweep_rates(0.75) == [0.38, 0.75, 1.5, 3.0]
    assert sweep_rates(0.0) == []
    assert run_seconds(0.25, 20.0) == 80.0 and run_seconds(2.0, 20.0) == 20.0
