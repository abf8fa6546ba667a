"""The KV transport interface: every in-process backend lands exactly what was published in the pool blocks a
sequence was given (runs of blocks or scattered ones; the digest of what landed is the seal's), gives it back as
arrays on the waiting path (same tokens), refuses a foreign handle, and frees what it holds once read or expired; the
fake backend's injected faults surface as typed hand-off errors or as a digest that does not match, never as a
half-built output. (NIXL over UCX: ``test_nixl_transport.py``.)"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from common.errors import HandoffError
from common.kv.blocks import check_landed, export_kv, seal
from common.kv.landing import Landing, runs
from common.kv.pool import KVPool
from common.kv.transport import KVTransport, make_transport
from common.kv.transport.fake import FakeTransport
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from tests.unit.common.kv.kv_decode_worker import fixed_request

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def published(tiny_llava):
    return seal(fixed_request(tiny_llava, 1, SAMPLING), "req-1")


def land(transport: KVTransport, handle, lm, blocks: list[int] | None = None) -> tuple[KVPool, list[int], int]:
    """Open ``handle`` and land it in a fresh pool, in ``blocks`` (default: scattered, three runs)."""
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    transport.attach(pool.arrays())
    pre = transport.open(handle)
    n = pre.layout.num_blocks
    blocks = blocks or [40 + i for i in range(n // 2)] + [3] + [10 + i for i in range(n - n // 2 - 1)]
    return pool, blocks, transport.land(pre, Landing.of(pre.layout, pool.arrays(), blocks))


def test_runs_group_consecutive_blocks():
    assert [(r.start, r.block, r.count) for r in runs([4, 5, 6, 1, 9, 10])] == [(0, 4, 3), (3, 1, 1), (4, 9, 2)]
    assert runs([]) == ()


@pytest.mark.parametrize("name", ["object_store", "fake"])
def test_a_handoff_lands_exactly_in_its_blocks(name, published, tiny_llava):
    transport: KVTransport = make_transport(name)
    assert transport.name == name
    pool, blocks, landed = land(transport, transport.publish(published, expires_at=time.time() + 60), tiny_llava)
    check_landed(published, landed)  # the digest of what lies in the pool is the seal's
    keys, values = pool.arrays()
    np.testing.assert_array_equal(keys[:, blocks], published.kv.keys)
    np.testing.assert_array_equal(values[:, blocks], published.kv.values)
    assert transport.release() == 0, "a read hand-off is freed"


@pytest.mark.parametrize("name", ["object_store", "fake"])
def test_the_waiting_path_fetches_the_same_output(name, published, tiny_llava):
    transport = make_transport(name)
    got = transport.fetch(transport.open(transport.publish(published, expires_at=time.time() + 60)))
    np.testing.assert_array_equal(got.kv.keys, published.kv.keys)
    np.testing.assert_array_equal(got.prompt_token_ids, published.prompt_token_ids)
    assert (got.first_token_id, got.rope_delta, got.model_revision, got.checksum) == (
        published.first_token_id,
        published.rope_delta,
        published.model_revision,
        published.checksum,
    )
    assert decode(tiny_llava, got, SAMPLING).token_ids == decode(tiny_llava, published, SAMPLING).token_ids


def test_a_landing_must_match_the_handoff(published, tiny_llava):
    pool = KVPool(64, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    with pytest.raises(ValueError, match="pool blocks for a hand-off"):
        Landing.of(published.layout, pool.arrays(), [1, 2])
    n = published.layout.num_blocks
    with pytest.raises(ValueError, match=f"pool blocks 60..{59 + n} outside a pool of 64"):
        Landing.of(published.layout, pool.arrays(), list(range(60, 60 + n)))
    small = KVPool(64, 8, tiny_llava.kv_shape, tiny_llava.dtype)  # (blocks of 8 tokens: another geometry)
    with pytest.raises(ValueError, match="into a pool of"):
        Landing.of(published.layout, small.arrays(), list(range(n)))
    assert Landing.of(published.layout, pool.arrays(), list(range(64 - n, 64))).runs[0].block == 64 - n


def test_a_bfloat16_handoff_lands_in_a_bfloat16_pool():
    """bfloat16 travels as its raw ``uint16`` bits, and the pool's arrays are those bits too: the landing's dtype check
    agrees, and the bits land as they left."""
    cache = DynamicCache()
    for i in range(3):
        k = torch.randn(1, 2, 37, 8).to(torch.bfloat16)
        cache.update(k, -k, i)
    kv = export_kv(cache, 16)
    pool = KVPool(16, 16, (3, 2, 8), torch.bfloat16)
    blocks = [5, 6, 2]
    for dst, src in Landing.of(kv.layout, pool.arrays(), blocks).pairs(kv.keys, kv.values):
        dst[...] = src
    np.testing.assert_array_equal(pool.arrays()[1][:, blocks], kv.values)


@pytest.mark.parametrize(("sender", "receiver"), [("fake", "object_store"), ("object_store", "fake")])
def test_foreign_handle_is_refused(sender, receiver, published):
    handle = make_transport(sender).publish(published, expires_at=time.time() + 60)
    with pytest.raises(HandoffError, match=f"transport is {receiver}"):
        make_transport(receiver).open(handle)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_transport("carrier-pigeon")  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["lose", "truncate"])
def test_injected_faults_raise_typed_errors(fault, published):
    transport = FakeTransport()
    transport.inject(fault)
    handle = transport.publish(published, expires_at=time.time() + 60)
    with pytest.raises(HandoffError):
        transport.open(handle)
    assert not transport.faults, "one fault per hand-off"


def test_a_corrupted_handoff_lands_with_a_digest_that_does_not_match(published, tiny_llava):
    transport = FakeTransport()
    transport.inject("corrupt")
    _, _, landed = land(transport, transport.publish(published, expires_at=time.time() + 60), tiny_llava)
    with pytest.raises(HandoffError, match="corrupted"):
        check_landed(published, landed)


def test_lost_handoff_stays_lost_and_truncation_is_one_read(published):
    transport = FakeTransport()
    lost = transport.publish(published, expires_at=time.time() + 60)
    kept = transport.publish(published, expires_at=time.time() + 60)
    transport.inject("lose", "truncate")
    with pytest.raises(HandoffError, match="gone"):
        transport.open(lost)
    with pytest.raises(HandoffError):
        transport.open(kept)  # half the bytes arrived
    with pytest.raises(HandoffError, match="gone"):
        transport.open(lost)
    assert transport.open(kept).layout.num_tokens == published.kv.num_tokens, "the sender's copy survives a bad read"


def test_delay_fault_only_slows_the_read(published):
    transport = FakeTransport(delay_s=0.2)
    handle = transport.publish(published, expires_at=time.time() + 60)
    transport.inject("delay")
    start = time.perf_counter()
    out = transport.open(handle)
    assert time.perf_counter() - start >= 0.2
    assert out.layout.num_tokens == published.kv.num_tokens


def test_unread_handoffs_expire(published):
    now = [1000.0]
    transport = FakeTransport(clock=lambda: now[0])
    transport.publish(published, expires_at=1010.0)
    assert transport.release() == 1 and transport.held == 1
    now[0] = 1011.0
    assert transport.release() == 0
