"""KV before prefill: a decode replica's pool reserves a request's blocks before its KV exists, the prefilled sequence
claims them, and what nobody claims goes back — in the pool, the engine, the admission rule and the deployment."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from common.admission.kv import KVAdmission
from common.engine.decode import DecodeEngine
from common.errors import DeadlineExceeded, Overloaded
from common.kv.pool import KVPool, LeaseTooLarge
from common.protocol.handoff import RequestContext
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from tests.unit.common.engine.test_decode_engine import _prefilled, _run

SHAPE = (2, 2, 8)


def _pool(blocks: int = 16, fraction: float = 1.0) -> KVPool:
    import torch

    return KVPool(blocks, 4, SHAPE, torch.float32, max_lease_fraction=fraction)


# ---- the pool ---------------------------------------------------------------------------------------------------
def test_a_held_reservation_shrinks_or_grows_into_what_is_available():
    pool = _pool(16)
    assert pool.request_lease("a", 6) is not None
    assert pool.resize_lease("a", 4) == [] and pool.lease("a").reserved == 4 and pool.available_blocks == 12
    pool.resize_lease("a", 10)  # 6 more: available, granted at once
    assert pool.granted("a") and pool.lease("a").reserved == 10 and pool.available_blocks == 6
    pool.release("a")
    pool.check_no_leaks()


def test_a_reservation_that_must_grow_waits_holding_nothing_at_the_head_of_the_queue():
    pool = _pool(16)
    pool.request_lease("a", 6)
    pool.request_lease("b", 8)
    assert pool.request_lease("c", 4) is None  # 2 left: c waits
    assert pool.resize_lease("a", 8) == []  # 2 more, 2 available: a is older than c, takes them
    assert pool.granted("a") and pool.available_blocks == 0
    pool.resize_lease("b", 12)  # 4 more, none available: b gives its 8 back and waits ahead of c
    assert not pool.granted("b") and pool.is_waiting("b")
    assert pool.waiting_in_rank_order() == ["b", "c"] and pool.available_blocks == 8 and pool.waiting_blocks == 16
    assert pool.release("a") == ["b", "c"]  # 16 free: b (12) first, then c (4)
    assert pool.granted("c") and pool.lease("b").reserved == 12
    for rid in ("b", "c"):
        pool.release(rid)
    pool.check_no_leaks()
    assert pool.freed_total == 8 + 8 + 12 + 4  # capacity given back: b's 8 to grow, then each reservation, unused


def test_a_waiting_reservation_keeps_its_place_when_resized_and_release_drops_it():
    pool = _pool(8, fraction=0.5)
    pool.request_lease("a", 4)
    pool.request_lease("big", 4)
    assert pool.request_lease("w1", 3) is None and pool.request_lease("w2", 1) is None
    pool.resize_lease("w1", 2)
    assert pool.waiting_in_rank_order() == ["w1", "w2"] and pool.waiting_blocks == 3
    with pytest.raises(LeaseTooLarge):
        pool.resize_lease("w1", 5)  # over the per-request limit (half of 8)
    with pytest.raises(KeyError):
        pool.resize_lease("nobody", 1)
    assert pool.release("a") == ["w1", "w2"]
    pool.release("w1")
    pool.release("w2")
    assert pool.release("nobody") == []
    lease = pool.lease("big")
    pool.allocate(lease, 2)
    with pytest.raises(ValueError):
        pool.resize_lease("big", 3)  # blocks in use: not a reservation any more
    pool.release("big")
    assert pool.freed_total == 4 + 2 + 1 + 4  # a, w1, w2 unused; big: 2 blocks freed + 2 reserved unused
    pool.check_no_leaks()


def test_the_queue_ranks_batch_class_behind_interactive_for_its_delay_and_never_longer():
    now = [1000.0]
    import torch

    pool = KVPool(8, 4, SHAPE, torch.float32, max_lease_fraction=1.0, clock=lambda: now[0])
    pool.request_lease("running", 8)
    delay = 10.0
    assert pool.request_lease("batch", 4, rank=1000.0 + delay) is None  # a batch-class reservation
    assert pool.request_lease("inter", 4, rank=1005.0) is None  # interactive, 5 s later: still ahead of it
    assert pool.request_lease("late", 4, rank=1020.0 + 0) is None  # interactive, past the delay: behind it
    now[0] = 1021.0
    assert pool.request_lease("plain", 2) is None  # no rank: the time it asked
    assert pool.waiting_in_rank_order() == ["inter", "batch", "late", "plain"]
    assert pool.release("running") == ["inter", "batch"]
    pool.resize_lease("inter", 6)  # grows past what is available: back to the head, holding nothing
    assert pool.waiting_in_rank_order() == ["inter", "late", "plain"] and not pool.granted("inter")
    for rid in ("batch", "inter", "late", "plain"):
        pool.release(rid)
    pool.check_no_leaks()
    assert not pool.num_waiting


# ---- the admission rule ----------------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_admission_refuses_what_would_wait_past_its_deadline_with_a_retry_after_from_the_drain_rate():
    pool, clock = _pool(16), _Clock()
    adm = KVAdmission(pool, max_waiting=2, retry_after_s=1.0, clock=clock)
    adm.check(8, left_s=0.001)  # fits now: never refused
    for rid in ("a", "b"):
        pool.allocate(pool.request_lease(rid, 8), 8)
    with pytest.raises(Overloaded) as refused:
        adm.check(4, left_s=0.5)  # nothing freed yet: the configured 1 s ≥ 0.5 s left
    assert refused.value.retry_after_s == 1.0 and "deadline" in str(refused.value)
    adm.check(4, left_s=5.0)  # may wait
    adm.sample()
    clock.t += 2.0
    pool.release("a")  # 8 blocks freed in 2 s: 4 blocks/s
    assert adm.drain_rate() == pytest.approx(4.0)
    pool.allocate(pool.request_lease("a2", 8), 8)
    assert adm.expected_wait_s(8) == pytest.approx(2.0)
    with pytest.raises(Overloaded) as slow:
        adm.check(8, left_s=1.5)
    assert slow.value.retry_after_s == 2.0
    pool.request_lease("w1", 2)
    pool.request_lease("w2", 2)
    with pytest.raises(Overloaded) as full:
        adm.check(1, left_s=60.0)  # two already wait: the queue is full
    assert "2 requests waiting" in str(full.value)
    assert adm.expected_wait_s(1, rank=-1.0) == pytest.approx(1 / 4)  # ranked ahead of both: only its own block
    clock.t += 3600  # the window forgets old releases: back to the configured value
    assert adm.drain_rate() is None and adm.retry_after_s(8) == 1.0
    clock.t += 2.0  # after the pause, the rate is what was freed since it ended, not averaged over the pause
    pool.release("a2")
    assert adm.drain_rate() == pytest.approx(4.0)


# ---- the engine --------------------------------------------------------------------------------------------------
def test_a_reserved_sequence_says_exactly_what_an_unreserved_one_says(tiny_llava):
    lm = tiny_llava
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [(f"r{i}", _prefilled(lm, i, i % 2, sampling), sampling) for i in range(4)]
    alone = {rid: list(decode(lm, pre, sp).token_ids) for rid, pre, sp in requests}
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    for i, (rid, pre, sp) in enumerate(requests):  # under, exactly at and over the need
        need = pool.blocks_for(pre.kv.num_tokens + sp.max_tokens)
        assert engine.reserve(rid, max(1, need + (i % 3) - 1))
    assert engine.num_reserved == 4
    assert _run(engine, requests) == alone
    assert engine.num_reserved == 0
    pool.check_no_leaks()


def _one(lm, i: int, images: int):
    """A prefilled request of 8 greedy tokens, its sampling and the KV blocks it needs (16-token blocks)."""
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    pre = _prefilled(lm, i, images, sampling)
    return pre, sampling, -(-(pre.kv.num_tokens + 8) // 16)


def test_a_full_pool_holds_reservations_back_until_blocks_free_and_unclaimed_ones_go_back(tiny_llava):
    lm = tiny_llava
    pre, sampling, need = _one(lm, 0, images=0)
    now = [0.0]
    pool = KVPool(2 * need, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool, clock=lambda: now[0])
    assert engine.reserve("a", need, deadline=10.0) and engine.reserve("b", need, deadline=10.0)
    assert not engine.reserve("c", need, deadline=10.0) and not engine.reservation_granted("c")
    engine.submit("a", pre, sampling)  # claims its reservation
    assert engine.unreserve("b") and not engine.unreserve("b")  # b's chain failed before decode
    assert engine.reservation_granted("c")  # b's blocks went to c
    assert not engine.reserve("d", need, deadline=5.0)  # waits behind a and c
    now[0] = 6.0
    assert engine.expire_reservations() == ["d"] and not engine.is_reserved("d")
    now[0] = 11.0
    assert engine.expire_reservations() == ["c"]  # granted but never claimed: back at its deadline
    while engine.has_work():
        engine.step()
    assert engine.reserve("e", 1)
    with pytest.raises(ValueError):
        engine.reserve("e", 1)
    assert not engine.cancel("e") and engine.num_reserved == 0  # (a reservation: no sequence was cancelled)
    pool.check_no_leaks()


def test_a_claim_that_needs_more_than_its_reservation_waits_without_holding_it(tiny_llava):
    lm = tiny_llava
    pre, sampling, need = _one(lm, 1, images=1)
    pool = KVPool(need + 1, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool)
    assert engine.reserve("small", 1)  # an estimate under the real need
    assert engine.reserve("other", need)  # the rest of the pool
    engine.submit("small", pre, sampling)
    assert engine.num_waiting == 1 and pool.used_blocks == 0 and not pool.granted("small")
    assert engine.unreserve("other")  # its blocks free: the claim is granted and admitted
    assert engine.num_waiting == 0 and engine.num_running == 1
    tokens = [e.token_id for e in _drain(engine)]
    assert tokens == list(decode(lm, pre, sampling).token_ids)
    pool.check_no_leaks()


def _drain(engine: DecodeEngine) -> list:
    events = []
    while engine.has_work():
        events += engine.step()
    return events


# ---- the deployment ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(model_cache):
    from services.stages.decode import DecodeDeployment

    config = {
        "model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1},
        "engine": {"kv_pool_blocks": 16, "max_lease_fraction": 0.5},
    }
    return DecodeDeployment(config)


def _ctx(rid: str, left_s: float) -> RequestContext:
    return RequestContext(rid, "t", time.time() + left_s, time.time())


def test_the_deployment_grants_waits_refuses_and_times_out(deployment):
    async def scenario() -> None:
        d = deployment
        got = await d.reserve(_ctx("a", 30), 8)
        assert got.replica is None and got.blocks == 8 and got.waited_s == 0  # (outside Serve: no replica id)
        await d.reserve(_ctx("b", 30), 8)  # the pool is fully reserved now
        with pytest.raises(Overloaded) as refused:
            await d.reserve(_ctx("c", 0.5), 4)  # nothing freed yet: it would wait ~1 s, past its deadline
        assert refused.value.http_status == 429 and refused.value.retry_after_s >= 1
        waiting = asyncio.ensure_future(d.reserve(_ctx("w", 30), 4))
        await asyncio.sleep(0.05)
        assert not waiting.done() and d.pool.is_waiting("w")
        assert await d.unreserve(_ctx("a", 30))  # a's chain failed: its blocks go to w
        assert (await asyncio.wait_for(waiting, 5)).waited_s > 0 and d.engine.reservation_granted("w")
        timed = asyncio.ensure_future(d.reserve(_ctx("x", 1.6), 8))  # ~1 s expected (no drain rate yet): it waits
        with pytest.raises(DeadlineExceeded):
            await timed
        await asyncio.sleep(0.05)
        assert not d.pool.is_waiting("x") and not d.engine.is_reserved("x")
        gone = asyncio.ensure_future(d.reserve(_ctx("y", 30), 8))
        await asyncio.sleep(0.05)
        gone.cancel()  # the ingress went away while it waited
        await asyncio.sleep(0.05)
        assert not d.engine.is_reserved("y")
        for rid in ("b", "w"):
            assert await d.unreserve(_ctx(rid, 30))
        assert d.engine.num_reserved == 0 and d.pool.used_blocks == 0 and d.pool.available_blocks == 16

    asyncio.run(scenario())


def test_reservations_never_commit_more_request_slots_than_the_replica_has(model_cache):
    """Each reservation's ``generate`` must find a slot on its replica: with 4 slots (one kept for control calls),
    three reservations are the most; a fourth is refused 429, a migration's too (the ingress then migrates without
    one)."""
    from services.stages.decode import DecodeDeployment

    config = {
        "model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1},
        "engine": {"kv_pool_blocks": 64},
        "deployments": {"decode": {"max_ongoing_requests": 4}},
    }
    d = DecodeDeployment(config)

    async def scenario() -> None:
        for rid in ("r1", "r2", "r3"):
            await d.reserve(_ctx(rid, 30), 2)
        with pytest.raises(Overloaded) as refused:
            await d.reserve(_ctx("r4", 30), 2)
        assert "request slots" in str(refused.value)
        with pytest.raises(Overloaded):
            await d.reserve(replace(_ctx("r4", 30), replay=(7,)), 2)  # a migration's
        for rid in ("r1", "r2", "r3"):
            assert await d.unreserve(_ctx(rid, 30))
        assert d.engine.num_reserved == 0 and d.pool.available_blocks == 64

    asyncio.run(scenario())


def test_the_deployment_grants_an_interactive_reservation_before_a_batch_one_that_came_first(deployment):
    async def scenario() -> None:
        d = deployment
        fillers = [_ctx(f"full-{i}", 30) for i in range(2)]
        for ctx in fillers:
            await d.reserve(ctx, 8)
        now = time.time()
        batch = RequestContext("batch", "t", now + 30, now, priority="batch")
        inter = RequestContext("inter", "t", now + 30, now + 0.01)
        waiting = [asyncio.ensure_future(d.reserve(c, 8)) for c in (batch, inter)]
        await asyncio.sleep(0.05)
        assert d.pool.waiting_in_rank_order() == ["inter", "batch"]
        await d.unreserve(fillers[0])
        await asyncio.sleep(0.05)
        assert waiting[1].done() and not waiting[0].done()
        await d.unreserve(fillers[1])
        await asyncio.wait_for(waiting[0], 5)
        for ctx in (batch, inter):
            assert await d.unreserve(ctx)
        assert d.engine.num_reserved == 0 and d.pool.available_blocks == 16

    asyncio.run(scenario())


def test_a_sequence_waiting_for_its_lease_with_nothing_running_times_out_without_steps(tiny_llava):
    """The decode driver steps only for running sequences: one waiting behind reservations is timed out by
    ``expire_waiting`` (the stage's sweep), its ``timeout`` event delivered by the next step."""
    lm = tiny_llava
    pre, sampling, need = _one(lm, 2, images=0)
    now = [0.0]
    pool = KVPool(need, 16, lm.kv_shape, lm.dtype, max_lease_fraction=1.0)
    engine = DecodeEngine(lm, pool, clock=lambda: now[0])
    assert engine.reserve("holder", need, deadline=100.0)
    engine.submit("late", pre, sampling, deadline=5.0)
    assert engine.num_waiting == 1 and not engine.has_work()  # nothing to step for
    now[0] = 6.0
    engine.expire_waiting()
    assert engine.has_work() and [(e.request_id, e.finish_reason) for e in engine.step()] == [("late", "timeout")]
    assert engine.unreserve("holder")
    pool.check_no_leaks()


def test_a_migration_without_a_request_slot_goes_on_without_a_reservation():
    """The ingress side: a refused reservation is a 429 for a new request, but a migration (``replay``) proceeds
    without one — its sequence leases when its KV arrives."""
    from common.config import PrismConfig
    from services.ingress.kv_reserver import KVReserver

    class _Refusing:
        class reserve:  # (the handle's method)
            @staticmethod
            def remote(*args):
                async def refused():
                    raise Overloaded("no request slot", retry_after_s=1)

                return asyncio.ensure_future(refused())

    reserver = KVReserver(PrismConfig(), _Refusing())

    async def scenario() -> None:
        ctx = _ctx("m", 30)
        migration = replace(ctx, replay=(7, 8))
        assert await reserver.reserve(migration, 4) == (migration, False)
        with pytest.raises(Overloaded):
            await reserver.reserve(ctx, 4)

    asyncio.run(scenario())
