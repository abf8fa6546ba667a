"""NIXL KV hand-off over UCX on this CPU machine: exact blocks, same tokens as the object-store path, buffers freed
on the reader's notification or at expiry."""

from __future__ import annotations

import time

import numpy as np
import pytest

from common.kv.blocks import seal, verify_handoff
from common.kv.transport.nixl import NixlTransport
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from tests.unit.common.kv.kv_decode_worker import fixed_request


@pytest.fixture(scope="module")
def agents():
    return NixlTransport(), NixlTransport(timeout_s=30)


def _wait_released(sender: NixlTransport, timeout: float = 10.0) -> int:
    deadline = time.time() + timeout
    while sender.release() and time.time() < deadline:
        time.sleep(0.01)
    return sender.held


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_nixl_handoff_gives_identical_blocks_and_tokens(agents, family, tiny_llava, tiny_qwen):
    lm = tiny_llava if family == "llava" else tiny_qwen
    sender, receiver = agents
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    local = seal(fixed_request(lm, 2, sampling), "req-1")
    remote = sender.publish(local, expires_at=time.time() + 60)
    assert remote.kv.nbytes == local.kv.keys.nbytes and sender.held == 1
    fetched = receiver.fetch(remote)
    np.testing.assert_array_equal(fetched.kv.keys, local.kv.keys)
    np.testing.assert_array_equal(fetched.kv.values, local.kv.values)
    assert (fetched.request_key, fetched.checksum) == ("req-1", local.checksum)  # the seal crosses with the READ
    verify_handoff(fetched, "req-1")
    assert decode(lm, fetched, sampling).token_ids == decode(lm, local, sampling).token_ids
    assert _wait_released(sender) == 0, "the reader's notification releases the sender's buffers"


def test_unread_handoffs_expire(agents, tiny_llava):
    sender, _ = agents
    out = fixed_request(tiny_llava, 0, SamplingParams(max_tokens=2))
    sender.publish(out, expires_at=time.time() + 0.2)
    assert sender.release() == 1
    assert sender.release(now=time.time() + 1.0) == 0
