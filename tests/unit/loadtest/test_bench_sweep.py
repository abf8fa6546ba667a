"""The goodput sweep's knee finder: where a server stops keeping up with the offered rate."""

from __future__ import annotations

import itertools

from loadtest.sweep import RATES, capacity, keeps_up, knee, past_peak, peak, run_seconds


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


def test_each_run_sends_enough_requests_and_the_rates_ascend_one_step_apart():
    assert run_seconds(0.25, 20.0) == 80.0 and run_seconds(2.0, 20.0) == 20.0
    assert list(RATES) == sorted(RATES) and {b - a for a, b in itertools.pairwise(RATES)} == {1.0}


def test_the_peak_is_the_most_goodput_at_the_lowest_rate_that_gave_it():
    assert peak([(3.0, 2.5), (1.0, 0.9), (2.0, 1.8), (4.0, 2.5), (5.0, 1.1)]) == (3.0, 2.5)
    assert peak([]) is None


def test_a_sweep_is_past_the_peak_only_once_the_server_falls_behind_and_delivers_less():
    # (rate, SLO attainment, goodput)
    assert not past_peak([(1.0, 1.0, 0.9)])
    assert not past_peak([(1.0, 1.0, 0.9), (2.0, 1.0, 1.9)])  # keeps up
    assert not past_peak([(1.0, 1.0, 0.9), (2.0, 0.85, 1.7)])  # behind, but still more goodput than before
    assert past_peak([(1.0, 1.0, 0.9), (2.0, 0.95, 1.9), (3.0, 0.5, 1.5)])
    assert not past_peak([(1.0, 1.0, 0.9), (2.0, 0.95, 1.9), (3.0, 0.91, 1.5)])  # less, yet keeping up: a noisy run
