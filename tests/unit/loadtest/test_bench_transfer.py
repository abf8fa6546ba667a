"""The hand-off measure, driven through the in-process fake transport: what is timed, and the arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from common.kv.transport.fake import FakeTransport
from loadtest import bench_transfer as bt


class StepClock:
    """Each reading advances a fixed step: a timed section between two readings lasts exactly ``step``."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_payload_goes_from_publish_into_the_receivers_own_pretouched_buffers():
    transport = FakeTransport(delay_s=0.0)  # one transport object: the fake's sender and receiver share its store
    sender, receiver = bt.Sender(transport), bt.Receiver(transport)
    nbytes = 4 << 20
    receiver.prepare(bt.payload_shape(nbytes))
    keys, values = receiver.buffers[(bt.payload_shape(nbytes), "float32")]
    assert not keys.any()  # allocated and touched (zeroed) before any timing
    handle, publish_s = sender.publish(nbytes)
    receive_s, moved = receiver.receive(handle)
    assert moved == nbytes and publish_s >= 0 and receive_s >= 0
    # the payload landed in the very buffers prepared beforehand (no allocation inside the timed section)
    assert receiver.buffers[(bt.payload_shape(nbytes), "float32")][0] is keys and keys.all() and values.all()


def test_the_figure_is_publish_plus_receive_against_one_memcpy_with_the_two_copy_floor():
    transport = FakeTransport(delay_s=0.0)
    sender = bt.Sender(transport, clock=StepClock(0.25))  # every publish takes 0.25 s on this clock
    receiver = bt.Receiver(transport, clock=StepClock(0.75))  # every receive 0.75 s
    nbytes = 1 << 20
    fig = bt.measure(sender.publish, receiver.receive, receiver.prepare, nbytes, repeats=3, memcpy=4.0 * nbytes)
    assert fig["repeats"] == 3 and fig["seconds"] == pytest.approx(1.0)
    assert fig["publish_s"] == pytest.approx(0.25) and fig["receive_s"] == pytest.approx(0.75)
    assert fig["bytes_per_s"] == pytest.approx(nbytes) and fig["fraction_of_memcpy"] == pytest.approx(0.25)
    assert fig["two_copy_floor"] == 0.5


def test_the_median_repeat_with_every_repeats_fraction_and_a_short_delivery_is_an_error():
    times = [(0.2, 0.9), (0.1, 0.5), (0.3, 0.3), (0.05, 0.35), (0.4, 0.4)]  # totals 1.1, 0.6, 0.6, 0.4, 0.8
    fig = bt.figure(1000, times, memcpy=10_000.0)
    assert fig["seconds"] == pytest.approx(0.6) and fig["repeats"] == 5  # not the best (0.4)
    assert fig["fractions"] == pytest.approx([1000 / t / 10_000.0 for t in (1.1, 0.6, 0.6, 0.4, 0.8)])
    assert bt.figure(1000, times[:4], memcpy=1.0)["seconds"] == pytest.approx(0.6)  # even count: the faster middle

    def short(handle):
        return 0.1, 1  # a receiver that got one byte

    receiver = bt.Receiver(FakeTransport(delay_s=0.0))
    sender = bt.Sender(receiver.transport)
    with pytest.raises(RuntimeError, match="moved 1 bytes"):
        bt.measure(sender.publish, short, receiver.prepare, 1 << 20, repeats=1, memcpy=1.0)


def test_payload_sizes_and_layout():
    assert bt.SIZES == (64 << 20, 256 << 20)
    out = bt.payload(64 << 20)
    assert out.kv.nbytes == 64 << 20 and out.kv.keys.shape == bt.payload_shape(64 << 20)
    assert out.kv.keys.dtype == np.float32
