"""Benchmark figures are judged on both their sides: a failed baseline is ``invalid``, never a pass."""

from __future__ import annotations

import math

import pytest

from loadtest.bench import table
from loadtest.figures import record
from loadtest.stats import RequestRecord, outcome_counts
from loadtest.verdict import judge


def _records(ok: int, failed: int = 0, timeouts: int = 0) -> list[RequestRecord]:
    good = [RequestRecord("text", 0.0, 200, ttft_s=0.1, e2e_s=0.2, output_tokens=4) for _ in range(ok)]
    bad = [RequestRecord("text", 0.0, 500, code="internal_error") for _ in range(failed)]
    late = [RequestRecord("text", 0.0, 0, code="client_timeout") for _ in range(timeouts)]
    return good + bad + late


def test_outcome_counts_say_what_the_percentiles_leave_out():
    counts = outcome_counts(_records(7, failed=2, timeouts=1))
    assert counts == {"requests": 10, "ok": 7, "errors": 3, "timeouts": 1, "error_fraction": 0.3}
    assert outcome_counts([])["error_fraction"] is None


def test_a_baseline_that_fails_everything_is_invalid_even_when_the_ratio_looks_like_a_win():
    sides = {"prism": outcome_counts(_records(50)), "naive": outcome_counts(_records(0, failed=50))}
    assert judge(10.0, ">=", 3.0, sides) == ("invalid", "naive: 50 of 50 requests failed (more than 1%)")
    m = record("goodput_ratio_vs_naive", [10.0], {"x": 1}, sides={"prism": _records(50), "naive": _records(0, 50)})
    assert m["status"] == "invalid" and m["met"] is False and m["sides"]["naive"]["errors"] == 50


def test_zero_goodput_is_invalid_not_infinitely_good():
    sides = {"prism": outcome_counts(_records(40)), "naive": outcome_counts(_records(40))}
    status, reason = judge(None, ">=", 3.0, sides, goodput={"prism": 1.5, "naive": 0.0})
    assert (status, reason) == ("invalid", "naive goodput is 0")
    assert judge(math.inf, ">=", 3.0)[0] == "invalid" and judge(math.nan, "<=", 1.0)[0] == "invalid"


@pytest.mark.parametrize(("failed", "status"), [(0, "met"), (1, "met"), (2, "invalid")])
def test_errors_up_to_one_percent_are_tolerated(failed, status):
    sides = {"a": outcome_counts(_records(100 - failed, failed=failed))}
    assert judge(1.0, "<=", 1.1, sides)[0] == status


def test_a_side_without_requests_is_invalid_and_timeouts_count_as_errors():
    assert judge(1.0, "<=", 1.1, {"monolith": outcome_counts([])}) == ("invalid", "monolith sent no requests")
    assert judge(1.0, "<=", 1.1, {"a": outcome_counts(_records(90, timeouts=10))})[0] == "invalid"


VALID = [(0.9, "<=", 1.1, "met"), (1.2, "<=", 1.1, "missed"), (12, ">=", 10, "met"), (6, ">=", 10, "missed")]


@pytest.mark.parametrize(("value", "op", "target", "status"), VALID)
def test_valid_figures_are_met_or_missed_against_their_target(value, op, target, status):
    assert judge(value, op, target, {"a": outcome_counts(_records(20))}) == (status, "")


def test_the_table_says_invalid_and_why_and_reads_summaries_written_before_the_status_field():
    bad = record("goodput_ratio_vs_naive", [None], {"x": 1}, sides={"prism": _records(5), "naive": _records(0, 5)})
    summary = {
        "date": "2026-12-01T00:00:00+00:00",
        "machine": {"cpus": 2, "platform": "p"},
        "model": "m",
        "wall_s": 1.0,
        "metrics": {
            "goodput_ratio_vs_naive": bad,
            "ttft_ratio_epd_vs_monolith": {"value": 1.2, "target": "<= 1.1", "met": False, "raw": {"x": 1}},
        },
    }
    text = table(summary)
    assert "| `goodput_ratio_vs_naive` | — | 1 | >= 3 | invalid: naive: 5 of 5 requests failed (more than 1%) |" in text
    assert "| `ttft_ratio_epd_vs_monolith` | 1.2 | 1 | <= 1.1 | no |" in text
