"""What UCX's own transport reaches here, under NIXL: one READ between two processes, nothing else in the timing.

The hand-off figure (:mod:`loadtest.bench_transfer`) times Prism's NIXL path as serving runs it: the receiver opens
the hand-off, READs the sender's staging arena into the decode pool's leased blocks and checks the seal on what
landed. This measures the ceiling under it — both buffers registered once, the peer known, each repeat only
``initialize_xfer`` + the READ + its completion — so the distance between the two is what Prism's path costs, not
what UCX can do. With UCX's default transport selection the READs are timed between the hand-offs they are compared
with (:func:`beside`: one READ after or before each hand-off of the same size, so that a slow spell of a shared
machine falls on both); with ``UCX_TLS`` pinned to shared memory (``sm``: SysV/POSIX segments; ``cma``: cross-memory
attach) and to TCP (each with ``tcp`` beside it: NIXL's UCX backend does not start with shared memory alone here)
on their own (:func:`figures`). Median of the repeats after one warm-up, as a fraction of the same run's memcpy.
:class:`Peer` is a plain class (a unit test drives two in one process); :func:`beside` and :func:`figures` run each
side in a Ray actor of its own (``ray.init`` by the caller).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from loadtest.figures import bandwidth

TRANSPORTS = {"default": None, "shared memory (sm)": "sm,tcp", "cross-memory attach (cma)": "cma,tcp", "tcp": "tcp"}
"""Label → ``UCX_TLS`` (``None``: UCX's own selection)."""


class Peer:
    """One NIXL agent with one registered buffer: the sender exposes it, the receiver READs into its own."""

    def __init__(self, name: str) -> None:
        from common.kv.transport.nixl_agent import new_agent

        self.agent = new_agent(name)
        self.buffer: np.ndarray | None = None
        self.peer, self.local, self.remote = "", None, None  # (a reader's, once connected)

    def expose(self, nbytes: int) -> tuple[bytes, int]:
        self.buffer = np.ones(nbytes, np.uint8)  # touched: written before it is registered
        self.agent.register_memory([(self.buffer.ctypes.data, nbytes, 0, "")], "DRAM")
        return self.agent.get_agent_metadata(), self.buffer.ctypes.data

    def connect(self, metadata: bytes, addr: int, nbytes: int) -> None:
        """Load the peer, register a destination of ``nbytes`` and describe both sides once: what a READ reuses."""
        agent = self.agent
        peer = agent.add_remote_agent(metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else peer
        self.buffer = np.zeros(nbytes, np.uint8)
        agent.register_memory([(self.buffer.ctypes.data, nbytes, 0, "")], "DRAM")
        self.local = agent.get_xfer_descs([(self.buffer.ctypes.data, nbytes, 0)], "DRAM")
        self.remote = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")

    def read_once(self) -> float:
        """Seconds of one READ of the connected peer's buffer into this one (``initialize_xfer`` to completion)."""
        agent = self.agent
        self.buffer[-1] = 0  # type: ignore[index]  # (set again only by this READ: checked below)
        start = time.perf_counter()
        xfer = agent.initialize_xfer("READ", self.local, self.remote, self.peer, b"bench")
        state = agent.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        seconds = time.perf_counter() - start
        if state != "DONE":
            raise RuntimeError("NIXL READ failed")
        if not self.buffer[-1]:  # type: ignore[index]
            raise RuntimeError("the READ did not land")
        return seconds


def beside(
    nbytes: int, tls: str | None = None, name: str = "bench-ucx"
) -> tuple[Callable[[], float], Callable[[], None]]:
    """Two peers (``UCX_TLS`` = ``tls``, unset for ``None``; each in a Ray actor of its own) connected over ``nbytes``
    and warmed by one READ: a callable that times one more READ, and one that ends them. :func:`figures` times a
    transport's READs with it; ``make bench`` times UCX's default READ between the hand-offs it is compared with, so
    that a slow spell of a shared machine falls on both (``ray.init`` by the caller)."""
    import ray

    env = {"env_vars": {"UCX_TLS": tls}} if tls else {}
    actor = ray.remote(num_cpus=0)(Peer).options(runtime_env=env)
    sender, receiver = actor.remote(f"{name}-s"), actor.remote(f"{name}-r")

    def end() -> None:
        ray.kill(sender)
        ray.kill(receiver)

    try:
        metadata, addr = ray.get(sender.expose.remote(nbytes))
        ray.get(receiver.connect.remote(metadata, addr, nbytes))
        ray.get(receiver.read_once.remote(), timeout=300)
    except BaseException:
        end()
        raise
    return (lambda: ray.get(receiver.read_once.remote(), timeout=300)), end


def failure(exc: BaseException) -> str:
    """An exception as a figure's ``error`` entry: its type and the end of its message."""
    return f"{type(exc).__name__}: {str(exc)[-300:]}"


def figures(nbytes: int, memcpy: float, repeats: int = 5, transports: dict[str, str | None] = TRANSPORTS) -> dict:
    """One READ figure per transport (an ``error`` entry where UCX would not start with it)."""
    out: dict[str, Any] = {}
    for label, tls in transports.items():
        try:
            read_once, end = beside(nbytes, tls, f"bench-ucx-{len(out)}")
            try:
                times = [read_once() for _ in range(repeats)]
            finally:
                end()
            out[label] = {"ucx_tls": tls or "unset", **bandwidth(nbytes, times, memcpy)}
        except Exception as exc:  # a transport this machine cannot run is a finding, not a failed benchmark
            out[label] = {"ucx_tls": tls or "unset", "error": failure(exc)}
    return out
