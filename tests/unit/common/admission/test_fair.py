"""Fair sharing between tenants at a gate: shares follow the weights under saturation, a lone tenant gets everything,
a newcomer goes next, nobody waits forever, batch still yields to interactive."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from common.admission.budget import BudgetGate
from common.errors import Overloaded
from common.fair import FairQueue, Waiter

_seq = itertools.count()


def _w(tenant: str, amount: int = 10, rank: float = 0.0, weight: float = 1.0, batch: bool = False) -> Waiter:
    return Waiter(rank, next(_seq), amount, tenant, weight, batch)


def _drain(q: FairQueue, n: int) -> list[str]:
    order = []
    for _ in range(n):
        head = q.head()
        if head is None:
            break
        q.pop(head)
        order.append(head.tenant)
    return order


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0), (2.0, 1.0)])
def test_under_saturation_each_tenant_gets_its_weights_share_of_the_units(weights):
    q = FairQueue()
    wa, wb = weights
    for i in range(200):  # both always backlogged; a's requests are twice b's size
        q.push(_w("a", 20, rank=i, weight=wa))
        q.push(_w("b", 10, rank=i, weight=wb))
    _drain(q, 150)
    share_a = q.service["a"] / (q.service["a"] + q.service["b"])
    assert share_a == pytest.approx(wa / (wa + wb), abs=0.03)


def test_a_lone_tenant_is_served_in_rank_order_and_a_newcomer_goes_next():
    q = FairQueue()
    for i in range(10):
        q.push(_w("flood", rank=10 - i))
    assert _drain(q, 4) == ["flood"] * 4
    assert q.service == {"flood": 40}
    q.push(_w("text", 1, rank=100.0))  # arrived last, ranked last: still next, it has had no service
    assert q.head().tenant == "text"
    ranks = []
    while (head := q.head()) is not None:
        q.pop(head)
        ranks.append((head.tenant, head.rank))
    flood = [r for t, r in ranks if t == "flood"]
    assert ranks[0] == ("text", 100.0) and flood == sorted(flood)


def test_an_idle_tenant_banks_no_credit_and_keeps_no_debt():
    q = FairQueue()
    for i in range(20):
        q.push(_w("a", rank=i))
    _drain(q, 10)  # b idle meanwhile
    for i in range(20):
        q.push(_w("b", rank=100 + i))
    order = _drain(q, 10)
    assert order.count("a") in (4, 5, 6)  # b arrives level with a: they alternate, b does not take 10 in a row


def test_nobody_waits_forever_while_another_tenant_keeps_arriving():
    q = FairQueue()
    q.served("slow", 1000)  # it was just served a lot: it waits while "busy" catches up
    q.push(_w("slow", 1000, rank=0.0))  # and its next request is large, 100 times the others
    grants = 0
    while True:
        q.push(_w("busy", 10, rank=grants + 1.0))  # busy always has one more waiting, ranked after slow's
        head = q.head()
        if head.tenant == "slow":
            break
        q.pop(head)
        grants += 1
        assert grants <= 200, "the large request never got its turn"
    assert 90 <= grants <= 101  # busy catches up the 1000 units it was behind (100 requests of 10), then slow goes
    q.pop(q.head())
    assert q.service == {"slow": 2000, "busy": grants * 10}


def test_batch_yields_to_interactive_until_its_class_delay_runs_out():
    q = FairQueue()
    q.push(_w("b", rank=50.0, batch=True))  # b has had no service, but its class waits
    q.push(_w("a", rank=10.0))
    q.served("a", 500)
    assert q.head().tenant == "a"
    q.pop(q.head())
    q.push(_w("a", rank=60.0))  # the batch request's rank is now before the earliest interactive one: it competes
    assert q.head().tenant == "b"


def test_waiters_that_gave_up_are_skipped_and_forgotten():
    async def main():
        q = FairQueue()
        loop = asyncio.get_running_loop()
        gone, stays = loop.create_future(), loop.create_future()
        q.push(Waiter(0.0, 0, 5, "a", 1.0, False, gone))
        q.push(Waiter(1.0, 1, 5, "a", 1.0, False, stays))
        gone.cancel()
        assert [w.rank for w in q.live()] == [1.0] and q.head().future is stays
        stays.cancel()
        assert q.head() is None and q._queues == {}  # (a tenant with nobody left waiting is forgotten)

    asyncio.run(main())


def test_the_gate_grants_a_newcomer_before_a_flooders_queue_and_does_not_refuse_it():
    async def main():
        gate = BudgetGate("media", "pixels", 100, max_waiting=64, retry_after_s=1.0)
        running = [await gate.acquire(100, deadline=1e12, rank=0.0, tenant="alpha")]
        flood = [
            asyncio.create_task(gate.acquire(100, deadline=gate.clock() + 30, rank=float(i), tenant="alpha"))
            for i in range(1, 40)
        ]
        await asyncio.sleep(0.01)
        # drain rate: 100 pixels released a second ago would put the 40th flood request ~39 s out
        gate._released.append((gate.clock() - 1.0, 100))
        assert gate.expected_wait_s(100, 99.0, "alpha") > 30
        with pytest.raises(Overloaded):  # alpha's next one would wait past its deadline: refused now
            await gate.acquire(100, deadline=gate.clock() + 30, rank=99.0, tenant="alpha")
        assert gate.expected_wait_s(10, 99.0, "beta") < 3  # beta's goes next: it waits for the running one only
        text = asyncio.create_task(gate.acquire(10, deadline=gate.clock() + 30, rank=99.0, tenant="beta"))
        await asyncio.sleep(0.01)
        gate.release(running.pop())
        grant = await asyncio.wait_for(text, 1)
        assert grant.amount == 10 and sum(t.done() for t in flood) == 0  # beta first; alpha's next waits for room
        gate.release(grant)
        for task in flood:
            gate.release(await task)
        assert gate.used == 0 and gate.waiting == 0
        assert gate.fair.service == {"alpha": 4000, "beta": 10}

    asyncio.run(main())


def test_a_queue_filled_by_one_tenant_still_takes_another_tenants_request():
    async def main():
        gate = BudgetGate("media", "pixels", 10, max_waiting=4, retry_after_s=1.0)

        def acquire(tenant: str, amount: int, rank: float) -> asyncio.Task:
            return asyncio.create_task(gate.acquire(amount, gate.clock() + 60, rank, tenant))

        held = await gate.acquire(10, gate.clock() + 60, 0.0, "alpha")
        flood = [acquire("alpha", 10, float(i)) for i in range(1, 5)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 4
        with pytest.raises(Overloaded) as full:  # alpha holds every place: its fifth is refused
            await gate.acquire(10, gate.clock() + 60, 9.0, "alpha")
        assert "at capacity" in full.value.message
        texts = [acquire("beta", 1, 9.0), acquire("beta", 1, 10.0)]  # beta's share of the 4 places is 2
        await asyncio.sleep(0.01)
        assert gate.waiting == 6 and not any(t.done() for t in texts)
        with pytest.raises(Overloaded):  # beta holds its share now
            await gate.acquire(1, gate.clock() + 60, 11.0, "beta")
        gate.release(held)
        granted = [await asyncio.wait_for(t, 1) for t in texts]  # beta's go first
        assert not any(t.done() for t in flood)
        for grant in granted:
            gate.release(grant)
        for task in flood:
            gate.release(await asyncio.wait_for(task, 1))
        assert gate.used == 0 and gate.waiting == 0

    asyncio.run(main())


def test_a_request_that_costs_nothing_does_not_move_the_fair_order():
    async def main():
        gate = BudgetGate("encode", "patches", 100, max_waiting=8, retry_after_s=1.0)
        held = await gate.acquire(100, gate.clock() + 60, 0.0, "alpha")
        small = asyncio.create_task(gate.acquire(10, gate.clock() + 60, 1.0, "gamma"))
        big = asyncio.create_task(gate.acquire(100, gate.clock() + 60, 0.5, "alpha"))
        await asyncio.sleep(0.01)
        vtime = gate.fair.vtime
        cached = await gate.acquire(0, gate.clock() + 60, 2.0, "alpha")  # an encoder-cache hit: nothing to wait for
        assert gate.fair.vtime == vtime and gate.fair.service == {"alpha": 100}
        gate.release(cached)
        gate.release(held)
        gate.release(await asyncio.wait_for(small, 1))  # gamma is owed: it goes before alpha's earlier-ranked one
        gate.release(await asyncio.wait_for(big, 1))

    asyncio.run(main())
