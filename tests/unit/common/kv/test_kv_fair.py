"""The decode stage's KV queue shares the pool between tenants (issue 34): each tenant's leases in rank order, the
tenant with the least service in blocks (÷ its weight) next — as every other stage budget's queue does."""

from __future__ import annotations

import pytest

from common.admission.kv import KVAdmission
from common.errors import Overloaded
from common.kv.pool import KVPool

SHAPE = (2, 2, 8)


def _pool(blocks: int = 16) -> KVPool:
    import torch

    return KVPool(blocks, 4, SHAPE, torch.float32, max_lease_fraction=1.0)


def _saturate(pool: KVPool, demands: dict[str, tuple[float, int]], rounds: int) -> dict[str, int]:
    """Each tenant keeps leases of ``blocks`` queued (weight, blocks); every round the oldest held lease finishes.
    Returns the leases granted per tenant."""
    seq, held, granted = 0, [], dict.fromkeys(demands, 0)

    def top_up() -> None:
        nonlocal seq
        for tenant, (weight, blocks) in demands.items():
            while sum(1 for rid in pool.waiting_in_rank_order() if rid.startswith(tenant)) < 4:
                seq += 1
                rid = f"{tenant}-{seq}"
                if pool.request_lease(rid, blocks, rank=float(seq), tenant=tenant, weight=weight) is not None:
                    held.append(rid)
                    granted[tenant] += 1

    top_up()
    for _ in range(rounds):
        for rid in pool.release(held.pop(0)):
            held.append(rid)
            granted[rid.split("-")[0]] += 1
        top_up()
    return granted


def test_under_saturation_each_tenants_blocks_converge_to_its_weight():
    pool = _pool(16)
    _saturate(pool, {"alpha": (1.0, 2), "beta": (1.0, 2)}, rounds=400)
    served = pool.served_blocks()
    assert served["alpha"] == pytest.approx(served["beta"], rel=0.05)

    pool = _pool(16)
    _saturate(pool, {"alpha": (3.0, 2), "beta": (1.0, 2)}, rounds=400)
    served = pool.served_blocks()
    assert served["alpha"] / served["beta"] == pytest.approx(3.0, rel=0.1)


def test_blocks_not_requests_are_shared_a_tenant_of_long_generations_does_not_starve_short_ones():
    """Leases hold prompt + max_tokens: a tenant asking 8 blocks a lease gets a quarter of the leases of one asking 2
    — the same blocks."""
    pool = _pool(16)
    granted = _saturate(pool, {"long": (1.0, 8), "short": (1.0, 2)}, rounds=400)
    served = pool.served_blocks()
    assert served["long"] == pytest.approx(served["short"], rel=0.1)
    assert granted["short"] > 3 * granted["long"]


def test_a_tenant_that_arrives_behind_a_flooders_queue_is_next_and_a_lone_tenant_keeps_rank_order():
    pool = _pool(8)
    pool.request_lease("running", 8, rank=0.0, tenant="alpha")
    for i in range(1, 6):
        assert pool.request_lease(f"a{i}", 4, rank=float(i), tenant="alpha") is None
    assert pool.waiting_in_rank_order() == ["a1", "a2", "a3", "a4", "a5"]  # alone: in rank order
    assert pool.request_lease("b1", 4, rank=10.0, tenant="beta") is None
    granted = pool.release("running")
    assert granted == ["b1", "a1"]  # beta has had nothing: its lease goes first, then alpha's oldest
    # what the admission rule counts ahead of a newcomer: the fair order's, not the whole queue
    assert pool.blocks_ahead(20.0, "gamma", 1.0, 4) < pool.blocks_ahead()
    for rid in ("b1", "a1", "a2", "a3", "a4", "a5"):
        pool.release(rid)
    pool.check_no_leaks()


def test_a_full_kv_queue_refuses_the_tenant_that_filled_it_not_the_others():
    pool = _pool(8)
    adm = KVAdmission(pool, max_waiting=4, retry_after_s=1.0)
    pool.allocate(pool.request_lease("running", 8, tenant="alpha"), 8)
    for i in range(4):
        pool.request_lease(f"a{i}", 2, rank=float(i), tenant="alpha")
    with pytest.raises(Overloaded, match="KV pool is full"):
        adm.check(2, left_s=60.0, tenant="alpha")
    adm.check(2, left_s=60.0, tenant="beta")  # under its share of the places: it may wait
    with pytest.raises(Overloaded):
        adm.check(2, left_s=60.0)  # (no tenant named: the plain rule)


def test_a_newcomers_wait_counts_what_others_get_before_it_starts_not_its_own_size():
    """Start-time fair queueing serves another tenant only until the newcomer's *start* tag: a large newcomer behind
    five tenants' small leases is next, whatever its own size."""
    pool = _pool(64)
    pool.request_lease("running", 64, rank=0.0, tenant="busy")
    for i, tenant in enumerate("abcde"):
        for j in range(3):
            pool.request_lease(f"{tenant}{j}", 2, rank=float(i * 3 + j + 1), tenant=tenant)
    big = 30
    assert pool.blocks_ahead(100.0, "newcomer", 1.0, big) <= 5 * 2  # at most one small lease of each
    assert pool.blocks_ahead(100.0, "newcomer", 1.0, 2) == pool.blocks_ahead(100.0, "newcomer", 1.0, big)


def test_a_lease_given_back_to_grow_is_charged_once():
    pool = _pool(16)
    pool.request_lease("other", 12, rank=0.0, tenant="beta")
    pool.request_lease("grow", 4, rank=1.0, tenant="alpha")
    assert pool.served_blocks()["alpha"] == 4
    pool.resize_lease("grow", 8)  # 4 more, none available: given back, waits for 8
    assert not pool.granted("grow") and pool.served_blocks()["alpha"] == 0
    pool.release("other")
    assert pool.granted("grow") and pool.served_blocks()["alpha"] == 8
