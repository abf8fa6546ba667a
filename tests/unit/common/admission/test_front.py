"""The front door's per-tenant shares of in-flight places (common/admission/front.py): work-conserving, fair by
weight, a newcomer in at once, a flooder's excess queued (then refused 429), nothing held by a caller that left."""

from __future__ import annotations

import asyncio

import pytest

from common.admission.front import FrontDoor, TenantShareExceeded, water_fill


def test_water_fill_gives_the_modest_what_they_want_and_splits_the_rest_by_weight():
    assert water_fill(32, {"alpha": 48, "beta": 1}, {"alpha": 1, "beta": 1}) == {"alpha": 31, "beta": 1}
    assert water_fill(32, {"alpha": 48, "beta": 48}, {"alpha": 1, "beta": 1}) == {"alpha": 16, "beta": 16}
    assert water_fill(32, {"alpha": 48, "beta": 48}, {"alpha": 3, "beta": 1}) == {"alpha": 24, "beta": 8}
    assert water_fill(32, {"alpha": 48}, {"alpha": 1}) == {"alpha": 32}


async def _fill(door: FrontDoor, tenant: str, n: int) -> list[asyncio.Task]:
    tasks = [asyncio.ensure_future(door.enter(tenant)) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


def test_a_lone_tenant_uses_every_place_and_queues_beyond_them():
    async def scenario() -> None:
        door = FrontDoor(places=4, max_waiting=2, retry_after_s=1)
        tasks = await _fill(door, "alpha", 6)
        assert door.in_flight == {"alpha": 4} and sum(t.done() for t in tasks) == 4
        with pytest.raises(TenantShareExceeded) as refused:
            await door.enter("alpha")
        assert refused.value.http_status == 429 and refused.value.retry_after_s == 1
        assert door.refused == {"alpha": 1} and door.waited == {"alpha": 2}
        door.leave("alpha")
        await asyncio.sleep(0)
        assert door.in_flight == {"alpha": 4} and sum(t.done() for t in tasks) == 5

    asyncio.run(scenario())


def test_a_second_tenant_gets_in_at_once_and_the_flooder_waits_until_it_is_back_within_its_share():
    async def scenario() -> None:
        door = FrontDoor(places=4, max_waiting=8, retry_after_s=1)
        alpha = await _fill(door, "alpha", 6)  # 4 in, 2 queued
        await asyncio.wait_for(door.enter("beta"), 0.1)  # under its share: in, though every place is held
        assert door.in_flight == {"alpha": 4, "beta": 1} and door.total == 5
        door.leave("alpha")  # alpha's share is 3 while beta holds one: its queue waits
        await asyncio.sleep(0)
        assert door.in_flight == {"alpha": 3, "beta": 1} and sum(t.done() for t in alpha) == 4
        door.leave("beta")  # beta gone: alpha alone again, and a place is free
        await asyncio.sleep(0)
        assert door.in_flight == {"alpha": 4} and sum(t.done() for t in alpha) == 5

    asyncio.run(scenario())


def test_under_saturation_places_converge_to_the_weights():
    async def scenario() -> None:
        weights = {"alpha": 3.0, "beta": 1.0}
        door = FrontDoor(places=8, max_waiting=100, retry_after_s=1, weight=weights.__getitem__)

        async def client(tenant: str) -> None:
            while True:
                await door.enter(tenant)
                try:
                    await asyncio.sleep(0.001)
                finally:
                    door.leave(tenant)

        clients = [asyncio.ensure_future(client(t)) for t in ("alpha", "beta") for _ in range(20)]
        samples = []
        for _ in range(200):
            await asyncio.sleep(0.0005)
            samples.append(dict(door.in_flight))
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        late = samples[50:]
        alpha = sum(s.get("alpha", 0) for s in late) / len(late)
        beta = sum(s.get("beta", 0) for s in late) / len(late)
        assert alpha / beta == pytest.approx(3.0, rel=0.25)
        assert door.total == 0 and not door.queues and not door.in_flight  # every place given back

    asyncio.run(scenario())


def test_a_caller_that_leaves_while_queued_or_as_it_gets_in_holds_nothing():
    async def scenario() -> None:
        door = FrontDoor(places=1, max_waiting=8, retry_after_s=1)
        await door.enter("alpha")
        waiting = asyncio.ensure_future(door.enter("alpha"))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not door.queues
        granted_then_cancelled = asyncio.ensure_future(door.enter("alpha"))
        await asyncio.sleep(0)
        door.leave("alpha")  # grants the waiter, which is cancelled before it resumes
        granted_then_cancelled.cancel()
        await asyncio.gather(granted_then_cancelled, return_exceptions=True)
        assert door.total == 0 and not door.in_flight and not door.queues

    asyncio.run(scenario())


def test_newcomers_never_take_the_door_past_twice_its_places():
    """Tenants arriving one by one each get their share while every place is held — up to 2 × places in all."""

    async def scenario() -> None:
        door = FrontDoor(places=4, max_waiting=8, retry_after_s=1)
        await _fill(door, "t0", 4)
        for i in range(1, 8):
            await _fill(door, f"t{i}", 4)
        assert door.total == 8 and door.total <= 2 * door.places
        assert sum(len(q) for q in door.queues.values()) == 7 * 4 + 4 - 8

    asyncio.run(scenario())
