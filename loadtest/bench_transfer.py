"""KV hand-off bandwidth between two processes, as a fraction of one warm memcpy measured in the same run.

What is timed. A prefill's KV payload (keys and values, ``nbytes`` in all) exists in the sender; the hand-off is
done when the payload sits in the receiver's own pre-allocated, pre-touched buffers — as the decode pool imports it.
So the time is the sender's ``publish`` (:class:`Sender`) plus the receiver's ``fetch`` and copy into its buffers
(:class:`Receiver`), each measured in its own process; the control-plane call between them (a few ms of Ray RPC,
the same for any payload size) is not bandwidth and is left out. The median of ``repeats`` (the fastest and slowest
beside it); the first hand-off between two fresh actors is a warm-up (NIXL agents connect, buffers get touched), as in
serving, where replicas live long.

* object store: ``publish`` is the transport's (the payload itself) sealed into Ray's store with ``ray.put`` — what
  Serve does with the prefill stage's response — copy one; the receiver maps it from shared memory and copies it
  into its buffers — copy two. Two copies of ``nbytes`` cannot beat half of memcpy: the **two-copy floor** is 0.5,
  stated beside the figure.
* NIXL (UCX, DRAM to DRAM on one machine): ``publish`` registers the sender's arrays; ``fetch`` READs them into
  buffers the transport allocates, then the receiver copies them into its own — also two passes over the payload.

Payloads of 64 MB and 256 MB for both; the headline figure of each transport is the lower of the two. Both need a
running Ray (``ray.init`` by the caller); :class:`Sender` and :class:`Receiver` themselves are plain classes (the unit
tests drive them through the fake transport, in one process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from common.kv.transport.base import KVTransport
from common.protocol.handoff import KVBlocks, PrefillOutput
from loadtest.bench_decode import memcpy_bytes_per_s
from loadtest.figures import bandwidth, median_index

SIZES = (64 << 20, 256 << 20)
TWO_COPY_FLOOR = 0.5
"""The best fraction of one memcpy that a hand-off making two full copies can reach."""


def payload_shape(nbytes: int) -> tuple[int, ...]:
    """Keys' (and values') shape of a float32 payload of ``nbytes``: (layers, blocks, heads, block size, head dim)."""
    return (1, nbytes // 2 // 4 // (16 * 64), 1, 16, 64)


def payload(nbytes: int) -> PrefillOutput:
    """A float32 KV payload of ``nbytes`` (keys and values half each), in the pool's block layout."""
    shape = payload_shape(nbytes)
    keys, values = np.ones(shape, np.float32), np.ones(shape, np.float32)
    kv = KVBlocks(16, shape[1] * 16, "float32", keys, values)
    return PrefillOutput(np.zeros(kv.num_tokens, np.int64), 0, kv, 0, "bench")


class Sender:
    """The prefill side: publishes a payload it already holds (built outside the timing)."""

    def __init__(self, transport: KVTransport, seal: Callable[[Any], Any] = lambda h: h, clock=time.perf_counter):
        self.transport, self.seal, self.clock = transport, seal, clock
        self.payloads: dict[int, PrefillOutput] = {}

    def publish(self, nbytes: int) -> tuple[Any, float]:
        out = self.payloads.get(nbytes) or self.payloads.setdefault(nbytes, payload(nbytes))
        start = self.clock()
        handle = self.seal(self.transport.publish(out, expires_at=time.time() + 120))
        return handle, self.clock() - start

    def release(self) -> int:
        return self.transport.release()


class Receiver:
    """The decode side: fetches a payload and copies it into buffers it allocated and touched beforehand."""

    def __init__(self, transport: KVTransport, open_: Callable[[Any], Any] = lambda h: h, clock=time.perf_counter):
        self.transport, self.open, self.clock = transport, open_, clock
        self.buffers: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def prepare(self, shape: tuple[int, ...], dtype: str = "float32") -> None:
        keys = np.empty(shape, np.dtype(dtype))
        keys.fill(0)  # touched: no first-touch page faults inside the timing
        self.buffers[(tuple(shape), dtype)] = (keys, keys.copy())

    def receive(self, handle: Any) -> tuple[float, int]:
        start = self.clock()
        out = self.transport.fetch(self.open(handle))
        keys, values = self.buffers[(tuple(out.kv.keys.shape), str(out.kv.keys.dtype))]
        np.copyto(keys, out.kv.keys)
        np.copyto(values, out.kv.values)
        return self.clock() - start, int(out.kv.nbytes)


def figure(nbytes: int, times: list[tuple[float, float]], memcpy: float) -> dict[str, Any]:
    """The figure of one payload size from ``(publish_s, receive_s)`` per repeat: the median repeat (by total time;
    the faster middle one of an even count) with its two parts, its bandwidth and fraction, and every repeat's
    fraction (:func:`loadtest.figures.bandwidth`)."""
    totals = [sum(t) for t in times]
    publish_s, receive_s = times[median_index(totals)]
    return {
        **bandwidth(nbytes, totals, memcpy),
        "publish_s": publish_s,
        "receive_s": receive_s,
        "two_copy_floor": TWO_COPY_FLOOR,
    }


def measure(sender_publish, receiver_receive, receiver_prepare, nbytes: int, repeats: int, memcpy: float) -> dict:
    """Drive one sender/receiver pair (local callables or actor wrappers that return plain values)."""
    receiver_prepare(payload_shape(nbytes))
    handle, _ = sender_publish(nbytes)
    receiver_receive(handle)  # warm-up
    times = []
    for _ in range(repeats):
        handle, publish_s = sender_publish(nbytes)
        receive_s, moved = receiver_receive(handle)
        if moved != nbytes:
            raise RuntimeError(f"hand-off moved {moved} bytes of {nbytes}")
        times.append((publish_s, receive_s))
    return figure(nbytes, times, memcpy)


# ---- the two real transports, each side in its own Ray actor ------------------------------------------------------


def _actors(kind: str):
    import ray

    def transport() -> KVTransport:
        from common.kv.transport import make_transport

        return make_transport(kind)

    # The object store's handle is a Ray object: sealed with ray.put in the sender, nested in a list so that Ray does
    # not resolve it on the way (the receiver's get is inside its timing, as the copy out of the store is).
    seal = (lambda h: [ray.put(h)]) if kind == "object_store" else (lambda h: h)
    open_ = (lambda h: ray.get(h[0])) if kind == "object_store" else (lambda h: h)

    @ray.remote(num_cpus=0)
    class SenderActor:
        def __init__(self) -> None:
            self.side = Sender(transport(), seal)

        def publish(self, nbytes: int):
            return self.side.publish(nbytes)

        def release(self) -> int:
            return self.side.release()

    @ray.remote(num_cpus=0)
    class ReceiverActor:
        def __init__(self) -> None:
            self.side = Receiver(transport(), open_)

        def prepare(self, shape) -> None:
            self.side.prepare(shape)

        def receive(self, handle):
            return self.side.receive(handle)

    return SenderActor.remote(), ReceiverActor.remote()


def transport_figures(kind: str, repeats: int = 5) -> dict[str, Any]:
    """Both payload sizes through ``kind`` (``object_store`` | ``nixl``); fresh actors per transport. The headline is
    the size with the lower median fraction; ``fractions`` are its repeats' (the figure's runs)."""
    import ray

    sender, receiver = _actors(kind)
    sizes = {}
    for nbytes in SIZES:
        memcpy = memcpy_bytes_per_s(nbytes)

        def publish(n: int):
            out = ray.get(sender.publish.remote(n))
            ray.get(sender.release.remote())  # NIXL: frees what earlier reads finished with
            return out

        sizes[str(nbytes)] = measure(
            publish,
            lambda h: ray.get(receiver.receive.remote(h)),
            lambda shape: ray.get(receiver.prepare.remote(shape)),
            nbytes,
            repeats,
            memcpy,
        )
    worst = min(sizes.values(), key=lambda f: f["fraction_of_memcpy"])
    out: dict[str, Any] = {
        "fraction_of_memcpy": worst["fraction_of_memcpy"],
        "headline_bytes": worst["bytes"],
        "fractions": worst["fractions"],
        "sizes": sizes,
    }
    if kind == "nixl":
        out["ucx_tls"] = os.environ.get("UCX_TLS", "UCX's default selection (UCX_TLS unset)")
    return out
