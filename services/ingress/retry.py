"""Bounded retries with jittered exponential backoff, for stage calls that failed because a replica went away.

Only failures that say nothing about the request itself are retried (a replica died or is restarting); a typed 4xx
or a deadline is final. Attempts are capped, and a retry is never started if its backoff would end past the
request's deadline — the client gets a prompt 503 instead of a late 504.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    deadline: float,
    retry_on: tuple[type[BaseException], ...],
    max_attempts: int | None = 3,
    base_delay_s: float = 0.1,
    max_delay_s: float = 1.0,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """``attempt()`` until it succeeds, raises what ``retry_on`` does not hold, ``max_attempts`` were made (``None``:
    no bound but the deadline), or the next backoff would end past ``deadline``."""
    rng = rng or random.Random()
    for n in itertools.count(1):
        try:
            return await attempt()
        except retry_on:
            delay = min(max_delay_s, base_delay_s * 2 ** min(n - 1, 32)) * (0.5 + rng.random())  # full jitter, 2^n
            if n == max_attempts or time.time() + delay >= deadline:
                raise
            await sleep(delay)
    raise AssertionError("unreachable")
