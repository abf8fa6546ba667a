"""UCX's own READ under NIXL, between two real agents (UCX on this CPU): the bytes land, and only the READ is timed."""

from __future__ import annotations

import pytest

from loadtest import bench_ucx
from loadtest.figures import bandwidth


def _connected(nbytes: int, name: str) -> tuple[bench_ucx.Peer, bench_ucx.Peer]:
    """A sender exposing ``nbytes`` of ones and a reader connected to it, in this process."""
    pytest.importorskip("nixl")
    sender, receiver = bench_ucx.Peer(f"{name}-s"), bench_ucx.Peer(f"{name}-r")
    receiver.connect(*sender.expose(nbytes), nbytes)
    return sender, receiver


def test_a_read_between_two_registered_buffers_lands_and_is_summarised():
    nbytes = 4 << 20
    _, receiver = _connected(nbytes, "bench-ucx-test")
    times = [receiver.read_once() for _ in range(3)]
    assert len(times) == 3 and all(t > 0 for t in times)
    assert receiver.buffer is not None and receiver.buffer.all()  # every byte of the sender's ones arrived
    fig = bandwidth(nbytes, times, memcpy=10e9)
    assert fig["repeats"] == 3 and fig["bytes_per_s"] == pytest.approx(nbytes / fig["seconds"])
    assert fig["fraction_of_memcpy"] == pytest.approx(fig["bytes_per_s"] / 10e9) and len(fig["fractions"]) == 3


def test_a_connected_reader_times_one_read_at_a_time_and_sees_the_bytes_land():
    sender, receiver = _connected(1 << 20, "bench-ucx-test2")
    assert receiver.buffer is not None and not receiver.buffer.any()
    assert receiver.read_once() > 0 and receiver.buffer.all()
    sender.buffer[-1] = 0  # type: ignore[index]  # (the last byte is what read_once checks landed)
    with pytest.raises(RuntimeError, match="did not land"):
        receiver.read_once()
