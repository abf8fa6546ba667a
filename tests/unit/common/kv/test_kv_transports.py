"""The KV transport interface: every in-process backend gives back exactly what was published (same blocks, same
tokens), refuses a foreign handle, and frees what it holds once read or expired; the fake backend's injected faults
surface as typed hand-off errors, never as a half-built output. (NIXL over UCX: ``test_nixl_transport.py``.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from common.errors import HandoffError
from common.kv.transport import KVTransport, make_transport
from common.kv.transport.fake import FakeTransport
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from tests.unit.common.kv.kv_decode_worker import fixed_request

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def published(tiny_llava):
    return fixed_request(tiny_llava, 1, SAMPLING)


@pytest.mark.parametrize("name", ["object_store", "fake"])
def test_round_trip_is_exact(name, published, tiny_llava):
    transport: KVTransport = make_transport(name)
    assert transport.name == name
    got = transport.fetch(transport.publish(published, expires_at=time.time() + 60))
    np.testing.assert_array_equal(got.kv.keys, published.kv.keys)
    np.testing.assert_array_equal(got.kv.values, published.kv.values)
    np.testing.assert_array_equal(got.prompt_token_ids, published.prompt_token_ids)
    assert (got.first_token_id, got.rope_delta, got.model_revision) == (
        published.first_token_id,
        published.rope_delta,
        published.model_revision,
    )
    assert decode(tiny_llava, got, SAMPLING).token_ids == decode(tiny_llava, published, SAMPLING).token_ids
    assert transport.release() == 0, "a read hand-off is freed"


@pytest.mark.parametrize(("sender", "receiver"), [("fake", "object_store"), ("object_store", "fake")])
def test_foreign_handle_is_refused(sender, receiver, published):
    handle = make_transport(sender).publish(published, expires_at=time.time() + 60)
    with pytest.raises(HandoffError, match=f"transport is {receiver}"):
        make_transport(receiver).fetch(handle)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_transport("carrier-pigeon")  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["lose", "truncate"])
def test_injected_faults_raise_typed_errors(fault, published):
    transport = FakeTransport()
    transport.inject(fault)
    handle = transport.publish(published, expires_at=time.time() + 60)
    with pytest.raises(HandoffError):
        transport.fetch(handle)
    assert not transport.faults, "one fault per fetch"


def test_lost_handoff_stays_lost_and_truncation_is_one_read(published):
    transport = FakeTransport()
    lost = transport.publish(published, expires_at=time.time() + 60)
    kept = transport.publish(published, expires_at=time.time() + 60)
    transport.inject("lose", "truncate")
    with pytest.raises(HandoffError, match="gone"):
        transport.fetch(lost)
    with pytest.raises(HandoffError):
        transport.fetch(kept)  # half the bytes arrived
    with pytest.raises(HandoffError, match="gone"):
        transport.fetch(lost)
    assert transport.fetch(kept).kv.num_tokens == published.kv.num_tokens, "the sender's copy survives a bad read"


def test_delay_fault_only_slows_the_read(published):
    transport = FakeTransport(delay_s=0.2)
    handle = transport.publish(published, expires_at=time.time() + 60)
    transport.inject("delay")
    start = time.perf_counter()
    out = transport.fetch(handle)
    assert time.perf_counter() - start >= 0.2
    assert out.kv.num_tokens == published.kv.num_tokens


def test_unread_handoffs_expire(published):
    now = [1000.0]
    transport = FakeTransport(clock=lambda: now[0])
    transport.publish(published, expires_at=1010.0)
    assert transport.release() == 1 and transport.held == 1
    now[0] = 1011.0
    assert transport.release() == 0
