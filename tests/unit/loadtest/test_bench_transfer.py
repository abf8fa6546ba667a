"""The hand-off measure, driven through the in-process fake transport: what is timed (the sender's publish; the
receiver's open, land in a lease's pool blocks and the seal's check), and the arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from common.kv.transport.fake import FakeTransport
from loadtest import bench_transfer as bt
from loadtest import machine

SMALL = 4 << 20


class StepClock:
    """Each reading advances a fixed step: a timed section between two readings lasts exactly ``step``."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture(scope="module")
def pair():
    transport = FakeTransport(delay_s=0.0)  # one transport object: the fake's sender and receiver share its store
    return bt.Sender(transport), bt.Receiver(transport)


def test_a_payload_lands_sealed_in_a_leases_pool_blocks_and_the_lease_is_given_back(pair):
    sender, receiver = pair
    handle, publish_s, export_s = sender.publish(SMALL)
    receive_s, moved = receiver.receive(handle, SMALL)
    assert moved == SMALL and min(publish_s, receive_s, export_s) >= 0
    tokens = bt.payload_tokens(SMALL)
    keys, _ = receiver.arrays  # the pool's own memory, registered once: the payload landed there, as exported
    cache = sender.caches[SMALL]
    landed = keys[0, : -(-tokens // bt.BLOCK)].reshape(-1, bt.HEADS, bt.HEAD_DIM)[:tokens]
    np.testing.assert_array_equal(landed, cache.layers[0].keys[0].transpose(0, 1).numpy())
    receiver.pool.check_no_leaks()  # the lease (reservation) was given back after the hand-off


def test_a_corrupted_payload_fails_the_measure(pair):
    sender, receiver = pair
    sender.transport.inject("corrupt")
    handle, _, _ = sender.publish(SMALL)
    with pytest.raises(Exception, match="corrupted"):
        receiver.receive(handle, SMALL)
    receiver.pool.check_no_leaks()


def test_the_figure_is_publish_plus_receive_against_one_memcpy_with_the_copy_floor():
    transport = FakeTransport(delay_s=0.0)
    sender = bt.Sender(transport, clock=StepClock(0.25))  # every section of a publish takes 0.25 s on this clock
    receiver = bt.Receiver(transport, clock=StepClock(0.75))  # every receive 0.75 s
    fig = bt.measure(sender.publish, receiver.receive, SMALL, repeats=3, memcpy=4.0 * SMALL, floor=0.5, warmups=2)
    assert fig["repeats"] == 3 and fig["seconds"] == pytest.approx(1.0) and fig["warmups"] == 2
    assert fig["publish_s"] == pytest.approx(0.25) and fig["receive_s"] == pytest.approx(0.75)
    assert fig["export_and_seal_s"] == pytest.approx(0.25) and fig["cold_seconds"] == pytest.approx(1.0)
    assert fig["bytes_per_s"] == pytest.approx(SMALL) and fig["fraction_of_memcpy"] == pytest.approx(0.25)
    assert fig["copy_floor"] == 0.5


def test_the_median_repeat_with_every_repeats_fraction_and_a_short_delivery_is_an_error(pair):
    times = [(0.2, 0.9, 0), (0.1, 0.5, 0), (0.3, 0.3, 0), (0.05, 0.35, 0), (0.4, 0.4, 0)]  # 1.1, .6, .6, .4, .8
    fig = bt.figure(1000, times, memcpy=10_000.0, floor=0.5)
    assert fig["seconds"] == pytest.approx(0.6) and fig["repeats"] == 5  # not the best (0.4)
    assert fig["fractions"] == pytest.approx([1000 / t / 10_000.0 for t in (1.1, 0.6, 0.6, 0.4, 0.8)])
    assert bt.figure(1000, times[:4], memcpy=1.0, floor=0.5)["seconds"] == pytest.approx(0.6)  # even: faster middle

    def short(handle, nbytes):
        return 0.1, 1  # a receiver that got one byte

    sender, _ = pair
    with pytest.raises(RuntimeError, match="moved 1 bytes"):
        bt.measure(sender.publish, short, SMALL, repeats=1, memcpy=1.0, floor=0.5)


def test_what_is_timed_beside_the_hand_offs_runs_after_then_before_them_alternately(pair):
    sender, receiver = pair
    order: list[str] = []

    def publish(n):
        order.append("hand-off")
        return sender.publish(n)

    def beside() -> float:
        order.append("beside")
        return 0.5 + len(order)

    fig = bt.measure(publish, receiver.receive, SMALL, repeats=4, memcpy=1.0, floor=0.5, warmups=1, beside=beside)
    assert order == ["hand-off"] + ["hand-off", "beside", "beside", "hand-off"] * 2  # (the warm-up: nothing beside)
    assert fig["beside_seconds"] == [3.5, 4.5, 7.5, 8.5] and len(fig["fractions"]) == 4
    assert "beside_seconds" not in bt.measure(sender.publish, receiver.receive, SMALL, 1, 1.0, 0.5)


def test_payload_geometry():
    assert bt.SIZES == (64 << 20, 256 << 20)
    assert bt.payload_tokens(64 << 20) * bt.TOKEN_BYTES == 64 << 20  # whole tokens: the bytes are exact
    assert bt.payload_tokens(256 << 20) % bt.BLOCK == 0
    cache = bt.payload_cache(SMALL)
    assert len(cache.layers) == bt.LAYERS and cache.layers[0].keys.shape == (1, bt.HEADS, 16, bt.HEAD_DIM)


def test_nixl_is_compared_with_ucx_at_the_size_ucx_read():
    """``nixl_vs_ucx_read`` divides the hand-offs of UCX's own size, not NIXL's headline (the worse size)."""
    from loadtest.bench_engine import nixl_versus_ucx

    nx = {
        "fractions": [0.2, 0.3],  # (the headline: the 64 MB hand-offs here)
        "sizes": {str(64 << 20): {"fractions": [0.2, 0.3]}, str(256 << 20): {"fractions": [0.4, 0.6]}},
        "ucx_read": {"default": {"fraction_of_memcpy": 0.8, "fractions": [0.5, 1.0]}},
    }
    ucx, versus = nixl_versus_ucx(nx, 256 << 20)
    assert ucx == 0.8 and versus == pytest.approx([0.8, 0.6])  # each hand-off over the READ timed beside it
    nx["ucx_read"] = {"default": {"error": "no UCX"}}
    assert nixl_versus_ucx(nx, 256 << 20) == (None, [None, None])


def test_a_ucx_read_that_fails_beside_the_hand_offs_is_recorded_not_raised(monkeypatch):
    """A READ that fails mid-run (a dead actor, a timeout) leaves the hand-offs measured and the ratio ``None``."""
    import math

    from loadtest import bench_engine, bench_ucx

    reads = iter([0.5, RuntimeError("NIXL READ failed")])

    def read_once() -> float:
        value = next(reads)
        if isinstance(value, Exception):
            raise value
        return value

    ended = []
    monkeypatch.setattr(bench_ucx, "beside", lambda size: (read_once, lambda: ended.append(size)))
    monkeypatch.setattr(bench_ucx, "figures", lambda *a: {})
    side_times = []

    def transport_figures(kind, repeats, beside=None):
        side = [beside[bt.SIZES[-1]]() for _ in range(repeats)]
        side_times.extend(side)
        size = {"fractions": [0.5] * repeats, "memcpy_bytes_per_s": 1e9, "beside_seconds": side}
        return {"fractions": [0.5] * repeats, "sizes": {str(bt.SIZES[-1]): size}}

    monkeypatch.setattr(bt, "transport_figures", transport_figures)
    nx = bench_engine.nixl_beside_ucx(3, {"default": None})
    assert side_times[0] == 0.5 and all(math.isnan(t) for t in side_times[1:])  # (no READ timed after the failure)
    assert nx["ucx_read"]["default"]["error"] == "RuntimeError: NIXL READ failed" and ended == [bt.SIZES[-1]]
    assert bench_engine.nixl_versus_ucx(nx, bt.SIZES[-1]) == (None, [None, None, None])


def test_each_size_says_whether_glibcs_memcpy_writes_around_the_caches_there():
    assert bt.memcpy_non_temporal(256 << 20, threshold=192 << 20) is True
    assert bt.memcpy_non_temporal(64 << 20, threshold=192 << 20) is False
    threshold = machine.glibc_copy().get("non_temporal_threshold")  # (this machine's glibc: None where it says none)
    assert bt.memcpy_non_temporal(64 << 20) == (None if threshold is None else 64 << 20 >= threshold)
