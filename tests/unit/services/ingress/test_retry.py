"""Retries: only replica loss is retried, attempts are capped, backoff is jittered and never outlives the deadline."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from services.ingress.retry import with_retries


class Lost(Exception):
    pass


def _run(coro):
    return asyncio.run(coro)


def test_retries_until_success_with_growing_jittered_delays():
    sleeps = []

    async def fake_sleep(d):  # injected, not patched: other event loops in the process use asyncio.sleep too
        sleeps.append(d)

    calls = []

    async def attempt():
        calls.append(1)
        if len(calls) < 3:
            raise Lost()
        return "ok"

    retried = with_retries(attempt, time.time() + 60, (Lost,), max_attempts=3, rng=random.Random(1), sleep=fake_sleep)
    assert _run(retried) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2
    assert 0.05 <= sleeps[0] <= 0.15 and 0.1 <= sleeps[1] <= 0.3


def test_gives_up_after_max_attempts_and_never_retries_other_errors():
    calls = []

    async def lost():
        calls.append(1)
        raise Lost()

    with pytest.raises(Lost):
        _run(with_retries(lost, time.time() + 60, (Lost,), max_attempts=2, base_delay_s=0.001))
    assert len(calls) == 2

    async def bad_request():
        calls.append(1)
        raise ValueError("400")

    with pytest.raises(ValueError):
        _run(with_retries(bad_request, time.time() + 60, (Lost,)))
    assert len(calls) == 3


def test_no_retry_that_would_end_past_the_deadline():
    calls = []

    async def lost():
        calls.append(1)
        raise Lost()

    with pytest.raises(Lost):
        _run(with_retries(lost, time.time() + 0.01, (Lost,), max_attempts=5, base_delay_s=0.5))
    assert len(calls) == 1


def test_without_an_attempt_bound_it_retries_until_the_deadline():
    """``max_attempts=None`` (a migration refused for a full queue): more than the default three attempts, and it
    stops only where the next backoff would end past the deadline."""
    failures = iter(range(6))
    slept: list[float] = []

    async def attempt():
        if next(failures, None) is not None:
            raise Lost()
        return "done"

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    got = with_retries(attempt, time.time() + 60, (Lost,), max_attempts=None, rng=random.Random(1), sleep=fake_sleep)
    assert _run(got) == "done" and len(slept) == 6 and max(slept) <= 1.5

    async def never():
        raise Lost()

    with pytest.raises(Lost):
        _run(with_retries(never, time.time() + 0.3, (Lost,), max_attempts=None))
