"""KV hand-off bandwidth between two processes through the serving path, as a fraction of one warm memcpy measured in
the same run.

The two sides are the stages' own parts, each in a process of its own:

* :class:`Sender` — a prefill replica's: a KV cache in transformers' layout (32 layers, 8 KV heads, head dim 128,
  fp32: a 7B-class geometry) is exported into the transport's buffers and sealed (:func:`export_sealed_kv`: the
  digest rides on the export, layer by layer) — the prefill's own work in any topology, timed apart as ``export_s``
  — then published: the transport's ``publish``, and for the object store ``ray.put`` of the result, what Serve does
  with the prefill's response.
* :class:`Receiver` — a decode replica's: a :class:`KVPool` the transport attached (registered) once; before each
  hand-off a lease is taken and its blocks allocated as one run, as the reservation and the engine's claim take them
  before the KV exists (outside the timing); then, timed, the transport's ``open``, ``land`` into those blocks, and
  the seal's check on the bytes as they lie in the pool.

The hand-off's time is ``publish_s + receive_s``; the control-plane call between the two (a few ms of Ray RPC, the
same for any payload size) is not bandwidth and is left out. The copies each path makes: object store — the put into
the store, the land from the store's shared memory into the pool blocks (hashed as it is written): two, so 0.5 of
memcpy at one memcpy's rate (``copy_floor``; the land is shared between the usable cores, so it may pass it); NIXL —
one READ from the sender's staging arena into the pool blocks, then a hash pass over what landed: one copy, so UCX's
own READ between registered buffers is its ceiling (:mod:`loadtest.bench_ucx`). The median of ``repeats`` (every
repeat's fraction beside it); the first hand-off between two fresh actors is a warm-up (NIXL agents connect, memory
gets touched), as in serving, where replicas live long. Payloads of 64 MB and 256 MB; the headline figure of each
transport is the lower of the two. Both need a running Ray (``ray.init`` by the caller); :class:`Sender` and
:class:`Receiver` themselves are plain classes (the unit tests drive them through the fake transport, in one process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from common.kv.blocks import check_key, check_landed, export_sealed_kv
from common.kv.digest import SCHEME
from common.kv.landing import Landing
from common.kv.pool import KVPool
from common.kv.transport.base import KVTransport
from common.protocol.handoff import PrefillOutput
from loadtest.figures import bandwidth, median_index
from loadtest.machine import glibc_copy
from loadtest.roofline import memcpy_bytes_per_s

SIZES = (64 << 20, 256 << 20)
LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 4
"""Keys and values of one token, fp32."""
COPY_FLOORS = {"object_store": 0.5, "nixl": 1.0, "fake": 0.5}
"""The best fraction of one memcpy each path can reach by its copies (two through the store, one READ with NIXL)."""
KEY = "bench-handoff"


def payload_tokens(nbytes: int) -> int:
    """Tokens of a KV of ``nbytes`` (keys and values) in the bench geometry."""
    return nbytes // TOKEN_BYTES


def payload_cache(nbytes: int) -> DynamicCache:
    """A prefill's cache of ``nbytes`` of KV, in transformers' head-major layout."""
    tokens, g = payload_tokens(nbytes), torch.Generator().manual_seed(0)
    cache = DynamicCache()
    for i in range(LAYERS):
        k, v = torch.randn(2, 1, HEADS, tokens, HEAD_DIM, generator=g)
        cache.update(k, v, i)
    return cache


class Sender:
    """The prefill side: exports and seals a cache it holds (built outside the timing), then publishes it."""

    def __init__(self, transport: KVTransport, seal: Callable[[Any], Any] = lambda h: h, clock=time.perf_counter):
        self.transport, self.seal, self.clock = transport, seal, clock
        self.caches: dict[int, DynamicCache] = {}

    def publish(self, nbytes: int) -> tuple[Any, float, float]:
        """(handle, publish seconds, export-and-seal seconds)."""
        cache = self.caches.get(nbytes) or self.caches.setdefault(nbytes, payload_cache(nbytes))
        start = self.clock()
        kv, checksum = export_sealed_kv(cache, BLOCK, self.transport.buffers)
        out = PrefillOutput(np.zeros(kv.num_tokens, np.int64), 0, kv, 0, "bench", KEY, checksum, SCHEME)
        exported = self.clock()
        handle = self.seal(self.transport.publish(out, expires_at=time.time() + 120))
        return handle, self.clock() - exported, exported - start

    def release(self) -> int:
        return self.transport.release()


class Receiver:
    """The decode side: a pool attached to the transport once; each hand-off lands in a lease's blocks."""

    def __init__(self, transport: KVTransport, open_: Callable[[Any], Any] = lambda h: h, clock=time.perf_counter):
        self.transport, self.open, self.clock = transport, open_, clock
        blocks = -(-payload_tokens(max(SIZES)) // BLOCK) + 4
        self.pool = KVPool(blocks, BLOCK, (LAYERS, HEADS, HEAD_DIM), torch.float32, max_lease_fraction=1.0)
        self.arrays = self.pool.arrays()
        self.arrays[0].fill(0)  # (touched: no first-touch faults inside the timing)
        self.arrays[1].fill(0)
        transport.attach(self.arrays)

    def receive(self, handle: Any, nbytes: int) -> tuple[float, int]:
        """(seconds of open + land + check, bytes that landed); the lease is taken before and given back after."""
        n = -(-payload_tokens(nbytes) // BLOCK)
        self.pool.request_lease(KEY, n)
        lease = self.pool.lease(KEY)
        assert lease is not None
        blocks = self.pool.allocate_run(lease, n) or self.pool.allocate(lease, n)
        try:
            start = self.clock()
            pre = self.transport.open(self.open(handle))
            check_key(pre, KEY)
            check_landed(pre, self.transport.land(pre, Landing.of(pre.layout, self.arrays, blocks)))
            return self.clock() - start, pre.layout.nbytes
        finally:
            self.pool.release(KEY)


def figure(nbytes: int, times: list[tuple[float, float, float]], memcpy: float, floor: float) -> dict[str, Any]:
    """The figure of one payload size from ``(publish_s, receive_s, export_s)`` per repeat: the median repeat (by
    hand-off time; the faster middle one of an even count) with its parts, its bandwidth and fraction, and every
    repeat's fraction (:func:`loadtest.figures.bandwidth`)."""
    totals = [p + r for p, r, _ in times]
    publish_s, receive_s, export_s = times[median_index(totals)]
    return {
        **bandwidth(nbytes, totals, memcpy),
        "publish_s": publish_s,
        "receive_s": receive_s,
        "export_and_seal_s": export_s,
        "copy_floor": floor,
    }


def measure(
    sender_publish,
    receiver_receive,
    nbytes: int,
    repeats: int,
    memcpy: float,
    floor: float,
    warmups: int = 1,
    beside: Callable[[], float] | None = None,
) -> dict:
    """Drive one sender/receiver pair (local callables or actor wrappers that return plain values): ``warmups``
    hand-offs first (the first one's time is reported as ``cold_seconds``), then ``repeats`` timed ones. ``beside``
    (seconds of something compared with the hand-offs) is timed next to each repeat — after it, then before the
    next, alternately: neither side always follows the other — its times as ``beside_seconds``, repeat by repeat."""
    cold = 0.0
    for _ in range(warmups):
        handle, publish_s, _ = sender_publish(nbytes)
        receive_s, _ = receiver_receive(handle, nbytes)
        cold = cold or publish_s + receive_s
    times, side = [], []
    for i in range(repeats):
        if beside is not None and i % 2:
            side.append(beside())
        handle, publish_s, export_s = sender_publish(nbytes)
        receive_s, moved = receiver_receive(handle, nbytes)
        if moved != nbytes:
            raise RuntimeError(f"hand-off moved {moved} bytes of {nbytes}")
        times.append((publish_s, receive_s, export_s))
        if beside is not None and not i % 2:
            side.append(beside())
    extra = {"beside_seconds": side} if beside is not None else {}
    return {**figure(nbytes, times, memcpy, floor), "warmups": warmups, "cold_seconds": cold, **extra}


# ---- the two real transports, each side in its own Ray actor ------------------------------------------------------


def _actors(kind: str):
    import ray

    def transport() -> KVTransport:
        from common.kv.transport import make_transport

        return make_transport(kind)

    # The object store's handle is a Ray object: sealed with ray.put in the sender, nested in a list so that Ray does
    # not resolve it on the way (the receiver's get is inside its timing, as Serve's resolution of the argument is).
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

        def receive(self, handle, nbytes: int):
            return self.side.receive(handle, nbytes)

    return SenderActor.remote(), ReceiverActor.remote()


def memcpy_non_temporal(nbytes: int, threshold: int | None = None) -> bool | None:
    """Whether glibc's memcpy of ``nbytes`` writes around the caches here (past its non-temporal threshold: one pass of
    memory traffic less than a copy that reads each destination line before writing it, so the baseline is faster at
    that size); ``None`` where glibc does not say (:func:`loadtest.machine.glibc_copy`)."""
    if threshold is None:
        threshold = glibc_copy().get("non_temporal_threshold")
    return None if threshold is None else nbytes >= threshold


def transport_figures(
    kind: str, repeats: int = 5, store_bytes: int = 0, beside: dict[int, Callable[[], float]] | None = None
) -> dict[str, Any]:
    """Both payload sizes through ``kind`` (``object_store`` | ``nixl``); fresh actors per transport, ended after. The
    headline is the size with the lower median fraction; ``fractions`` are its repeats' (the figure's runs).
    ``beside``: per size, what :func:`measure` times between its hand-offs. Warm-ups: enough
    hand-offs to have cycled twice through ``store_bytes`` of object store (each process maps the store's pages on
    first touch, once: long-lived replicas have), at least one. Twice: the store does not place successive objects in
    order, and after one pass some 64 MB puts still landed on pages the sender had never touched (18 ms for the put
    instead of 6: its 16 k page faults) in the timed repeats."""
    import ray

    sender, receiver = _actors(kind)
    sizes = {}
    try:
        for nbytes in SIZES:
            memcpy = memcpy_bytes_per_s(nbytes)

            def publish(n: int):
                ray.get(sender.release.remote())  # NIXL: frees the slots earlier reads finished with
                return ray.get(sender.publish.remote(n))

            warmups = 1 + 2 * -(-store_bytes // nbytes)
            receive = lambda h, n: ray.get(receiver.receive.remote(h, n))  # noqa: E731
            side = (beside or {}).get(nbytes)
            sizes[str(nbytes)] = measure(publish, receive, nbytes, repeats, memcpy, COPY_FLOORS[kind], warmups, side)
            sizes[str(nbytes)]["memcpy_non_temporal"] = memcpy_non_temporal(nbytes)
    finally:  # (their NIXL agents' threads, or their pools, are not left beside what is measured next)
        for actor in (sender, receiver):
            ray.kill(actor)
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
