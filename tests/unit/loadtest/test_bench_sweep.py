"""The goodput sweep's knee finder: where a server stops keeping up with the offered rate."""

from __future__ import annotations

import itertools

from loadtest.sweep import RATES, START, capacity, keeps_up, knee, next_rate, past_peak, peak, peak_located, run_seconds


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


def _sweep(results: dict[float, tuple[float, float]], start: float = 2.0, also: tuple[float, ...] = ()) -> list[float]:
    """The rates :func:`next_rate` runs, in order, for a server whose run at each rate gives (attainment, goodput)."""
    points: list[tuple[float, float | None, float]] = []
    while (rate := next_rate(points, RATES, start, also)) is not None:
        assert rate not in [p[0] for p in points], "a rate runs once"
        points.append((rate, *results[rate]))
    return [p[0] for p in points]


def test_a_sweep_starts_at_two_goes_down_while_behind_then_up_until_past_the_peak():
    keeps_up_to_3 = {1.0: (1.0, 0.7), 2.0: (1.0, 2.0), 3.0: (0.95, 2.8), 4.0: (0.6, 2.2), 5.0: (0.3, 1.5)}
    assert _sweep(keeps_up_to_3) == [2.0, 3.0, 4.0]  # past its peak at 4: nothing above, nothing below 2
    behind_at_2 = {1.0: (0.95, 0.7), 2.0: (0.7, 1.4), 3.0: (0.4, 1.2), 4.0: (0.1, 0.4)}
    assert _sweep(behind_at_2) == [2.0, 1.0, 3.0]  # its capacity lies below 2; more goodput at 2 than at 1: 3 runs
    behind_everywhere = {1.0: (0.5, 0.5), 2.0: (0.2, 0.4), 3.0: (0.1, 0.3)}
    assert _sweep(behind_everywhere) == [2.0, 1.0]  # less at 2 than at 1: past its peak at 2 already
    assert capacity([(1.0, 0.5), (2.0, 0.2), (3.0, 0.1)]) is None
    never_falls = {r: (1.0, r) for r in RATES}
    assert _sweep(never_falls) == [r for r in RATES if r >= 2.0]  # the top rate ends the climb
    assert _sweep(never_falls, start=0.5) == list(RATES)  # a start off the grid: from the lowest rate, as before


def test_behind_but_still_delivering_more_the_climb_goes_on():
    noisy = {2.0: (0.85, 1.7), 3.0: (0.8, 2.4), 4.0: (0.5, 2.0), 1.0: (1.0, 0.7)}
    assert _sweep(noisy) == [2.0, 1.0, 3.0, 4.0]


def test_from_the_default_start_the_naive_server_climbs_down_to_its_knee_and_the_others_also_run_it():
    """The bench's sweeps: Prism's and the monolith's also run the naive server's knee, below where they start."""
    naive = {5.0: (0.3, 1.5), 6.0: (0.2, 1.2), 4.0: (0.65, 2.2), 3.0: (1.0, 2.5)}
    ran = _sweep(naive, START)
    assert ran == [5.0, 4.0, 3.0] and knee([(r, naive[r][0]) for r in ran]) == 4.0  # past its peak at 5: no 6
    assert peak_located([(r, *naive[r]) for r in ran])
    # Behind at 5 with more goodput there than at 4 (the peak may lie above): the descent, then the climb.
    rising = {5.0: (0.8, 4.0), 4.0: (0.95, 3.8), 6.0: (0.5, 3.0)}
    assert _sweep(rising, START) == [5.0, 4.0, 6.0]
    prism = {r: (1.0, r) if r <= 7 else (0.8 if r == 8 else 0.4, 7.5 if r == 8 else 5.0) for r in RATES}
    assert _sweep(prism, START, also=(4.0,)) == [5.0, 6.0, 7.0, 8.0, 9.0, 4.0]
    assert _sweep(prism, START, also=(5.0, 11.0)) == [5.0, 6.0, 7.0, 8.0, 9.0]  # (ran already / not a rate)


def test_a_peak_is_located_only_where_a_higher_rate_ran_and_delivered_less_falling_behind():
    # (rate, SLO attainment, goodput)
    assert peak_located([(5.0, 1.0, 5.0), (6.0, 0.95, 5.9), (7.0, 0.6, 4.0)])
    assert not peak_located([(5.0, 1.0, 5.0), (6.0, 1.0, 6.0)])  # the top of what ran: at least that much
    assert not peak_located([(5.0, 1.0, 5.0), (6.0, 0.92, 4.9)])  # less, yet keeping up: a noisy run
    assert peak_located([(3.0, 1.0, 3.0), (4.0, 0.5, 2.0), (5.0, 0.3, 1.5)])
    assert not peak_located([])


def test_a_rate_run_for_the_caller_above_where_the_climb_stopped_does_not_restart_the_climb():
    """An extra rate joins the climb only when the climb reaches it: a lucky run there must not skip the rates below it
    or send the climb on above it."""
    peaked_at_6 = {5.0: (1.0, 5.0), 6.0: (1.0, 6.0), 7.0: (0.5, 4.0), 9.0: (1.0, 9.0)}
    assert _sweep(peaked_at_6, START, also=(9.0,)) == [5.0, 6.0, 7.0, 9.0]
    behind_at_7 = {
        5.0: (1.0, 5.0),
        6.0: (1.0, 6.0),
        7.0: (0.85, 6.5),
        8.0: (0.5, 4.0),
        4.0: (0.7, 2.8),
        3.0: (1.0, 3.0),
    }
    assert _sweep(behind_at_7, START, also=(4.0,)) == [5.0, 6.0, 7.0, 8.0, 4.0, 3.0]  # (4 joins the descent: behind)
