"""NIXL KV hand-off over UCX on this CPU machine (two agents in one process): the sender exports into its staging
arena and the receiver READs straight into its registered pool's blocks — exact blocks, the seal's digest, the same
tokens as the object-store path — with nothing allocated or registered per hand-off; slots are freed on the reader's
notification or at expiry; a full arena falls back to sending by value; the waiting path (fetch) still works."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from common.errors import HandoffError
from common.kv.blocks import check_landed, seal
from common.kv.landing import Landing
from common.kv.pool import KVPool
from common.kv.transport.nixl import NixlTransport, RemotePrefillOutput
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from tests.unit.common.kv.kv_decode_worker import fixed_request


@pytest.fixture(scope="module")
def agents():
    return NixlTransport(staging_bytes=8 << 20), NixlTransport(timeout_s=30)


@pytest.fixture(scope="module")
def pools(agents, tiny_llava, tiny_qwen):
    """One pool per model, attached (registered) to the receiver once."""
    out = {}
    for family, lm in (("llava", tiny_llava), ("qwen", tiny_qwen)):
        out[family] = KVPool(64, 16, lm.kv_shape, lm.dtype)
        agents[1].attach(out[family].arrays())
    return out


def staged(sender: NixlTransport, out: PrefillOutput) -> PrefillOutput:
    """``out`` exported into the sender's staging arena, as the prefill engine exports through ``buffers``."""
    keys, values = sender.buffers(out.kv.keys.shape, out.kv.keys.dtype)
    keys[...], values[...] = out.kv.keys, out.kv.values
    return dataclasses.replace(out, kv=dataclasses.replace(out.kv, keys=keys, values=values))


def _wait_released(sender: NixlTransport, timeout: float = 10.0) -> int:
    deadline = time.time() + timeout
    while sender.release() and time.time() < deadline:
        time.sleep(0.01)
    return sender.held


def _land(receiver: NixlTransport, pool: KVPool, handle, blocks: list[int]) -> int:
    pre = receiver.open(handle)
    return receiver.land(pre, Landing.of(pre.layout, pool.arrays(), blocks))


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_nixl_lands_exact_blocks_in_the_pool_and_the_same_tokens(agents, pools, family, tiny_llava, tiny_qwen):
    lm = tiny_llava if family == "llava" else tiny_qwen
    sender, receiver = agents
    pool = pools[family]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    local = seal(staged(sender, fixed_request(lm, 2, sampling)), "req-1")
    remote = sender.publish(local, expires_at=time.time() + 60)
    assert isinstance(remote, RemotePrefillOutput) and remote.layout == local.layout and sender.held == 1
    n = local.kv.num_blocks
    blocks = [30 + i for i in range(n - 1)] + [5]  # two runs: one descriptor each per array and layer
    check_landed(remote, _land(receiver, pool, remote, blocks))  # the seal crosses; the digest is of the pool's bytes
    keys, values = pool.arrays()
    np.testing.assert_array_equal(keys[:, blocks], local.kv.keys)
    np.testing.assert_array_equal(values[:, blocks], local.kv.values)
    fetched = receiver.fetch(remote)  # the waiting path: arrays here
    assert decode(lm, fetched, sampling).token_ids == decode(lm, local, sampling).token_ids
    assert _wait_released(sender) == 0, "the reader's notifications release the sender's slot"


def test_a_landing_of_many_transfers_is_hashed_as_they_land(agents, pools, tiny_llava, monkeypatch):
    """One transfer per descriptor (each array, layer and run of blocks): the checksum taken behind them is the
    seal's, and a byte changed in the sender's arena after the seal is caught on what landed."""
    from common.kv.transport import nixl

    monkeypatch.setattr(nixl, "GROUP_BYTES", 1)
    sender, receiver = agents
    pool = pools["llava"]
    for corrupt in (False, True):
        local = seal(staged(sender, fixed_request(tiny_llava, 3, SamplingParams(max_tokens=4))), "req-many")
        remote = sender.publish(local, expires_at=time.time() + 60)
        n = local.kv.num_blocks
        blocks = [9 + i for i in range(n - 1)] + [7]
        if corrupt:
            local.kv.values.reshape(-1)[-1] += 1  # (the arena's bytes: what the receiver READs)
            with pytest.raises(HandoffError, match="corrupt"):
                check_landed(remote, _land(receiver, pool, remote, blocks))
        else:
            check_landed(remote, _land(receiver, pool, remote, blocks))
            np.testing.assert_array_equal(pool.arrays()[1][:, blocks], local.kv.values)
    assert _wait_released(sender) == 0


def test_handoffs_allocate_and_register_nothing_per_request(agents, pools, tiny_llava):
    """Around 20 hand-offs into the pool: no registration and no allocation on either side (the arena and the pool
    were registered once); every slot comes back."""
    sender, receiver = agents
    pool = pools["llava"]
    out = fixed_request(tiny_llava, 1, SamplingParams(max_tokens=4))
    staged(sender, out)  # (the arena exists from here on)
    _wait_released(sender, 0)
    sender.release(now=time.time() + 120)
    before = (sender.registrations, sender.allocations, receiver.registrations, receiver.allocations)
    for i in range(20):
        sealed = seal(staged(sender, out), f"req-{i}")
        handle = sender.publish(sealed, expires_at=time.time() + 60)
        check_landed(handle, _land(receiver, pool, handle, list(range(sealed.kv.num_blocks))))
    assert (sender.registrations, sender.allocations, receiver.registrations, receiver.allocations) == before
    assert _wait_released(sender) == 0


def test_a_full_arena_sends_by_value_and_unread_slots_expire(agents, pools, tiny_llava):
    sender, receiver = agents
    out = fixed_request(tiny_llava, 1, SamplingParams(max_tokens=4))
    held = []
    while (remote := sender.publish(staged(sender, out), expires_at=time.time() + 0.5)) is not None and isinstance(
        remote, RemotePrefillOutput
    ):
        held.append(remote)
    assert isinstance(remote, PrefillOutput) and sender.allocations >= 1  # the arena is full: by value, counted
    blocks = list(range(remote.kv.num_blocks))
    _land(receiver, pools["llava"], remote, blocks)  # (lands by copy)
    assert sender.release() == len(held)
    assert sender.release(now=time.time() + 1) == 0, "unread hand-offs expire at their deadline"


def test_a_landing_outside_the_registered_pool_is_refused(agents, tiny_llava):
    sender, receiver = agents
    out = seal(staged(sender, fixed_request(tiny_llava, 0, SamplingParams(max_tokens=2))), "req")
    remote = sender.publish(out, expires_at=time.time() + 60)
    stray = KVPool(8, 16, tiny_llava.kv_shape, tiny_llava.dtype)  # never attached
    with pytest.raises(HandoffError, match="registered pool"):
        _land(receiver, stray, remote, list(range(out.kv.num_blocks)))
    sender.release(now=time.time() + 120)


def test_the_agents_progress_thread_sleeps_between_rounds():
    """NIXL's Python API starts the progress thread with no delay (a spinning core per agent); new_agent wraps the
    one constructor that takes the config. Pinned: the wrapped names exist, the delay reaches the agent (two idle
    agents cost well under a core between them), and the constructor is put back."""
    import nixl._api as api

    from common.kv.transport.nixl_agent import new_agent

    assert hasattr(api.nixlBind, "nixlAgent") and hasattr(api.nixlBind.nixlAgentConfig(), "pthrDelay")
    real = api.nixlBind.nixlAgent
    agents = [new_agent(f"idle-{i}") for i in range(2)]
    assert api.nixlBind.nixlAgent is real
    start = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - start < 0.5, "idle NIXL agents spin"
    del agents


def _embeddings(lm, n_images: int) -> list:
    from common.media.synthetic import synthetic_image
    from common.stages.encode import encode_media
    from common.stages.process import process_images

    images = [synthetic_image(200 + 40 * i, 160, seed=i) for i in range(n_images)]
    return encode_media(lm, process_images(lm, images))


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_embeddings_land_in_the_receivers_arena_checked_and_the_slot_comes_back(agents, family, tiny_llava, tiny_qwen):
    from common.kv.transport.nixl import RemoteEmbeddings

    lm = tiny_llava if family == "llava" else tiny_qwen
    sender, receiver = agents
    items = _embeddings(lm, 2)
    receiver.receive_embeddings(sender.send_embeddings(items, time.time() + 60))[1]()  # (the landing arena exists)
    before = (sender.registrations, sender.allocations, receiver.registrations, receiver.allocations)
    for _ in range(20):
        handle = sender.send_embeddings(items, expires_at=time.time() + 60)
        assert isinstance(handle, RemoteEmbeddings) and handle.nbytes == sum(i.embeddings.nbytes for i in items)
        got, free = receiver.receive_embeddings(handle)
        for a, b in zip(got, items, strict=True):
            np.testing.assert_array_equal(a.embeddings, b.embeddings)
            assert (a.media_index, a.media_digest, a.grid_thw, a.modality) == (
                b.media_index, b.media_digest, b.grid_thw, b.modality)  # fmt: skip
        free()
    assert (sender.registrations, sender.allocations, receiver.registrations, receiver.allocations) == before
    assert _wait_released(sender) == 0


def test_embeddings_altered_before_the_read_are_refused(agents, tiny_llava):
    sender, receiver = agents
    handle = sender.send_embeddings(_embeddings(tiny_llava, 1), expires_at=time.time() + 60)
    arena = sender.agent._staging
    arena.buffer[handle.items[0].addr - arena.address] ^= 0x40  # one bit of the staged bytes, in place
    with pytest.raises(HandoffError, match="corrupted"):
        receiver.receive_embeddings(handle)
    sender.release(now=time.time() + 120)


def test_embeddings_by_value_are_taken_as_they_are(agents, tiny_llava):
    _, receiver = agents
    items = _embeddings(tiny_llava, 1)
    got, free = receiver.receive_embeddings(items)
    assert got is items
    free()
    with pytest.raises(HandoffError, match="embeddings"):
        receiver.receive_embeddings("not embeddings")


def test_a_sender_that_dies_before_the_read_is_a_lost_handoff(tiny_llava):
    """The prefill replica died mid-transfer: the READ fails at once as a lost hand-off (the ingress issues the chain
    again), the receiver forgets the dead peer, and its pool is not held by anything of the transport."""
    import gc

    from common.errors import HandoffLost

    sender, receiver = NixlTransport(staging_bytes=4 << 20), NixlTransport(timeout_s=10)
    pool = KVPool(16, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    receiver.attach(pool.arrays())
    out = seal(staged(sender, fixed_request(tiny_llava, 0, SamplingParams(max_tokens=2))), "req")
    remote = sender.publish(out, expires_at=time.time() + 60)
    del sender, out
    gc.collect()  # (the agent goes with it: its memory and its endpoint)
    start = time.monotonic()
    with pytest.raises(HandoffLost):
        _land(receiver, pool, remote, list(range(remote.layout.num_blocks)))
    assert time.monotonic() - start < 5 and not receiver.agent._peers


def _read_then_die(handle, nbytes: int, reading) -> None:
    """A decode replica's side in a process of its own: its pool registered, it starts the hand-off's READ."""
    from loadtest.bench_transfer import Receiver

    receiver = Receiver(NixlTransport(timeout_s=30))
    reading.set()
    receiver.receive(handle, nbytes)


def test_a_decode_replica_killed_mid_read_leaves_nothing_held_by_the_sender():
    """The decode replica dies (SIGKILL) as its READ of a 64 MB hand-off starts: the sender's staging slot, never
    notified as read, comes back at the hand-off's expiry; nothing was registered for it; the sender's agent then
    serves the next reader as before (the dead peer wedges nothing). The decode side's pool and lease die with its
    process; the ingress issues the request again (``test_inprocess_pipeline``'s lost-replica tests)."""
    import multiprocessing

    from loadtest.bench_transfer import Receiver, Sender

    nbytes = 64 << 20
    sender = Sender(NixlTransport(staging_bytes=2 * nbytes))
    handle, _, _ = sender.publish(nbytes)
    assert isinstance(handle, RemotePrefillOutput)
    registered = sender.transport.registrations
    spawn = multiprocessing.get_context("spawn")
    reading = spawn.Event()
    reader = spawn.Process(target=_read_then_die, args=(handle, nbytes, reading), daemon=True)
    reader.start()
    assert reading.wait(120)
    reader.kill()
    reader.join(30)
    sender.transport.release()
    assert sender.transport.release(now=time.time() + 121) == 0, "the unread slot expires with its hand-off"
    handle, _, _ = sender.publish(nbytes)
    start = time.monotonic()
    _, landed = Receiver(NixlTransport(timeout_s=30)).receive(handle, nbytes)
    assert landed == handle.layout.nbytes and time.monotonic() - start < 10
    assert _wait_released(sender.transport) == 0 and sender.transport.registrations == registered


def test_a_prepared_transport_makes_nothing_on_its_first_handoff(tiny_llava):
    """The stages prepare their transport at start: the agent (~0.5 s to make here) and both arenas exist before
    the first request, whose hand-offs — KV and embeddings — then register nothing."""
    sender, receiver = NixlTransport(staging_bytes=8 << 20), NixlTransport()
    for transport in (sender, receiver):
        transport.prepare()
    pool = KVPool(32, 16, tiny_llava.kv_shape, tiny_llava.dtype)
    receiver.attach(pool.arrays())
    assert sender.agent._agent is not None and (sender.registrations, receiver.registrations) == (2, 3)
    out = seal(staged(sender, fixed_request(tiny_llava, 1, SamplingParams(max_tokens=2))), "req")
    blocks = [30, 2, *range(5, 5 + out.kv.num_blocks - 2)]  # (scattered: three runs)
    check_landed(out, _land(receiver, pool, sender.publish(out, expires_at=time.time() + 60), blocks))
    handle = sender.send_embeddings(_embeddings(tiny_llava, 1), expires_at=time.time() + 60)
    receiver.receive_embeddings(handle)[1]()
    assert (sender.registrations, receiver.registrations, sender.allocations, receiver.allocations) == (2, 3, 0, 0)
    assert _wait_released(sender) == 0
    decode_side = NixlTransport()
    decode_side.prepare(sends=False, receives=True)  # (a role the replica lacks gets no arena: RDMA pins them)
    assert decode_side.registrations == 1 and decode_side.agent._staging is None


def test_an_export_never_published_gives_its_staging_slot_back(tiny_llava):
    """A prefill whose caller went away between the export and the publish discards the export: its slot is free at
    once (not 60 s later); a published hand-off is not the discarder's to free."""
    sender = NixlTransport(staging_bytes=8 << 20)
    out = staged(sender, fixed_request(tiny_llava, 1, SamplingParams(max_tokens=2)))
    assert sender.held == 1
    sender.discard(out)
    assert sender.held == 0 and sender.agent._staging.used_bytes == 0
    published = staged(sender, out)
    sender.publish(published, expires_at=time.time() + 60)
    sender.discard(published)
    assert sender.held == 1, "a published slot waits for its reader or its expiry"
    sender.release(now=time.time() + 61)
