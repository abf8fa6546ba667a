"""A stage's budget gate: admits by size, queues in rank order, refuses what cannot wait, never leaks a unit."""

from __future__ import annotations

import asyncio

import pytest

from common.admission.budget import BudgetGate, rank
from common.errors import DeadlineExceeded, Overloaded


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _gate(capacity=100, max_waiting=4, clock=None, retry_after_s=2.0) -> BudgetGate:
    return BudgetGate("encode", "patches", capacity, max_waiting, retry_after_s=retry_after_s, clock=clock or Clock())


def test_admits_in_rank_order_and_releases_everything():
    async def main():
        gate = _gate()
        first = await gate.acquire(80, deadline=2000, rank=0)
        order: list[str] = []

        async def wait(name: str, amount: int, r: float) -> None:
            grant = await gate.acquire(amount, deadline=2000, rank=r)
            order.append(name)
            await asyncio.sleep(0)
            gate.release(grant)

        tasks = [asyncio.create_task(wait(n, a, r)) for n, a, r in (("late-big", 50, 3.0), ("small", 10, 1.0))]
        await asyncio.sleep(0.01)
        assert gate.waiting == 1 and order == ["small"]  # it ranks ahead of the waiting big one and fits beside the 80
        gate.release(first)
        await asyncio.gather(*tasks)
        return gate, order

    gate, order = asyncio.run(main())
    assert order == ["small", "late-big"] and gate.used == 0 and gate.waiting == 0


def test_full_queue_and_hopeless_deadline_are_429_with_retry_after_from_the_drain_rate():
    async def main():
        clock = Clock()
        gate = _gate(max_waiting=1, clock=clock)
        held = await gate.acquire(100, deadline=2000, rank=0)
        waiter = asyncio.create_task(gate.acquire(100, deadline=2000, rank=1))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as full:
            await gate.acquire(10, deadline=2000, rank=2)
        assert full.value.http_status == 429 and "encode stage is at capacity" in full.value.message
        assert full.value.retry_after_s == 2.0  # nothing drained yet: the configured value
        gate.release(held)  # 100 drained at t=1000 → rate 100/s over the 1 s floor
        second = await waiter
        clock.t += 1.0
        with pytest.raises(Overloaded) as hopeless:  # 10 over the budget at 100/s: ~0.1 s; its deadline is in 0.05 s
            await gate.acquire(10, deadline=clock.t + 0.05, rank=3)
        assert "deadline" in hopeless.value.message and hopeless.value.retry_after_s == 1.0
        gate.release(second)
        return gate

    assert asyncio.run(main()).used == 0


def test_deadline_while_waiting_is_504_and_a_cancelled_waiter_leaves_the_queue():
    async def main():
        gate = _gate(capacity=10, retry_after_s=0.01)  # (expects a short wait, so it queues)
        held = await gate.acquire(10, deadline=10**9, rank=0)
        with pytest.raises(DeadlineExceeded):
            await gate.acquire(5, deadline=gate.clock() + 0.05, rank=1)  # (the fake clock: wait_for times out)
        behind = asyncio.create_task(gate.acquire(5, deadline=10**9, rank=2))
        blocker = asyncio.create_task(gate.acquire(10, deadline=10**9, rank=1))
        await asyncio.sleep(0.01)
        blocker.cancel()  # its client went away: it must not hold "behind" back any more
        await asyncio.sleep(0.01)
        gate.release(held)
        grant = await behind
        gate.release(grant)
        return gate

    gate = asyncio.run(main())
    assert gate.used == 0 and gate.waiting == 0


def test_an_amount_over_the_budget_runs_alone_and_rank_orders_short_and_interactive_first():
    async def main():
        gate = _gate(capacity=10)
        grant = await gate.acquire(10_000, deadline=10**9, rank=0)
        assert grant.amount == 10 and gate.used == 10
        gate.release(grant)

    asyncio.run(main())
    assert rank(10.0, 20, 100.0, False, 5.0) < rank(10.0, 2000, 100.0, False, 5.0)  # shortest first
    assert rank(10.0, 2000, 100.0, False, 5.0) < rank(40.0, 20, 100.0, False, 5.0)  # aging: 20 s later loses
    assert rank(12.0, 20, 100.0, False, 5.0) < rank(10.0, 20, 100.0, True, 5.0)  # batch behind interactive


def test_nothing_to_admit_never_waits_and_a_first_ranked_waiter_that_fits_goes_at_once():
    async def main():
        gate = _gate(capacity=10, max_waiting=1)
        held = await gate.acquire(8, deadline=10**9, rank=0)
        big = asyncio.create_task(gate.acquire(5, deadline=10**9, rank=5))  # waits: 8 + 5 > 10
        await asyncio.sleep(0.01)
        free = await gate.acquire(0, deadline=10**9, rank=9)  # an encoder-cache hit: nothing to wait for
        assert free.amount == 0 and free.waited_s == 0
        gate.max_waiting = 2
        small = await asyncio.wait_for(gate.acquire(1, deadline=10**9, rank=1), timeout=1)  # ranks first, fits
        assert gate.used == 9 and not big.done()
        with pytest.raises(DeadlineExceeded):
            await gate.acquire(5, deadline=gate.clock() - 1, rank=0)  # its deadline already passed: 504, not 429
        for g in (held, small):
            gate.release(g)
        gate.release(await big)
        return gate

    assert asyncio.run(main()).used == 0
