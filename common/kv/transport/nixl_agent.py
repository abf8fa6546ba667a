"""A replica's NIXL agent and the memory it registers once: what :mod:`common.kv.transport.nixl` moves bytes with.

One :class:`Agent` per replica and transport, made on first use:

* **staging** (sending side): an arena registered the first time anything is staged; each hand-off's bytes are written
  into a slot of it (:meth:`Agent.stage`), the slot gets a transfer id when the hand-off is published
  (:meth:`Agent.publish`) and is freed when the reader's ``done:<id>`` notification arrives or the hand-off expires
  (:meth:`Agent.release`). A slot staged but never published lapses :data:`UNPUBLISHED_HOLD_S` later.
* **landing** (receiving side): memory the reader READs into — its KV pool, registered by :meth:`Agent.attach` at
  start, and an arena of its own for payloads that land outside the pool (:meth:`Agent.land_slot`: visual
  embeddings), registered the first time it is used.
* **peers**: a sender's metadata is loaded once per peer (again when it changed, or after a failed transfer).
  :meth:`Agent.read` READs a hand-off's pieces as a few transfers, calling back as each is done, then notifies the
  sender; it returns only when nothing is in flight any more, whatever happened.

:attr:`Agent.registrations` and :attr:`Agent.allocations` count what a hand-off would cost per request if it did (a
test holds them still over 20 hand-offs). NIXL registers numpy memory as ``(address, nbytes, device 0, "")`` in
``DRAM``; transfers complete only with the agent's progress thread on, which :func:`new_agent` makes sleep between
rounds instead of spinning.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from common.errors import HandoffError, HandoffLost
from common.kv.transport.arena import Arena

log = logging.getLogger("prism.nixl")

STAGING_BYTES = 256 << 20
LANDING_BYTES = 64 << 20
UNPUBLISHED_HOLD_S = 60.0
"""How long a slot staged but never published (its request cancelled in between) is kept."""
PROGRESS_DELAY_US = 100
"""The agent's progress thread sleeps this long between rounds. NIXL's Python API (1.5.1) starts it with no delay: a
thread that spins a core whether or not anything moves — two idle agents took both cores of this machine
(1.98 CPU-s/s), and a 64 MB READ between them ran at 8 ms instead of 5 ms with 100 µs (idle: 0.07 CPU-s/s; the
notification still arrived in 0.1 ms)."""
_AGENT_LOCK = threading.Lock()

Spans = list[tuple[int, int]]
"""(address, length) pieces of memory, in order."""


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and a progress thread that sleeps :data:`PROGRESS_DELAY_US` between rounds.
    The Python API builds the C++ agent's config itself (``nixl._api.nixlBind.nixlAgent(name, config)``, with
    ``config.pthrDelay = 0``) and exposes no delay, so the constructor is wrapped for the one call — pinned to nixl
    1.5.1 by a test that fails when either name moves."""
    from nixl import _api  # imported lazily: only replicas using NIXL pay for it

    real = _api.nixlBind.nixlAgent

    def delayed(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, config)

    with _AGENT_LOCK:
        _api.nixlBind.nixlAgent = delayed
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
        finally:
            _api.nixlBind.nixlAgent = real


@dataclass(frozen=True)
class PeerRef:
    """Who holds a published hand-off: the sender's agent, its metadata, the hand-off's transfer id."""

    agent_name: str
    agent_metadata: bytes
    transfer_id: str


@dataclass
class _Slot:
    transfer_id: str | None
    expires_at: float


class Agent:
    def __init__(self, name: str | None = None, timeout_s: float = 30.0, staging_bytes: int = STAGING_BYTES):
        self.name = name or f"prism-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.staging_bytes = staging_bytes
        self.registrations = 0
        """``register_memory`` calls: one per arena and attached pool, plus one per payload that had to be read
        outside them."""
        self.allocations = 0
        """Hand-off arrays allocated: a staging arena that was full, a payload read outside the registered memory."""
        self._agent: Any = None
        self._lock = threading.Lock()  # the agent and the slots
        self._arena_lock = threading.Lock()  # making an arena (not the agent's lock: making the agent takes that one)
        self._staging: Arena | None = None
        self._landing: Arena | None = None
        self._metadata = b""
        self._slots: dict[int, _Slot] = {}  # staging offset → its hand-off
        self._peers: dict[str, int] = {}  # agent name → digest of the metadata loaded for it
        self._peers_lock = threading.Lock()
        self._attached: Spans = []

    @property
    def agent(self) -> Any:
        with self._lock:
            if self._agent is None:
                self._agent = new_agent(self.name)
            return self._agent

    def prepare(self, sends: bool, receives: bool) -> None:
        """The agent now, and the arenas of the roles the replica has (their pages still arrive on first use; with an
        RDMA NIC registered memory is pinned, so a role it lacks gets none)."""
        self.agent  # noqa: B018 (made here)
        if sends:
            self._arena("_staging", self.staging_bytes)
        if receives:
            self._arena("_landing", LANDING_BYTES)

    def register(self, spans: Spans) -> Any:
        reg = self.agent.register_memory([(addr, n, 0, "") for addr, n in spans], "DRAM")
        self.registrations += 1
        return reg

    def deregister(self, reg: Any) -> None:
        self.agent.deregister_memory(reg)

    # ---- sending ----------------------------------------------------------------------------------------------
    def _arena(self, which: str, nbytes: int) -> Arena:
        with self._arena_lock:
            arena = getattr(self, which)
            if arena is None:
                arena = Arena(nbytes)
                self.register([(arena.address, arena.nbytes)])
                if which == "_staging":
                    self._metadata = self.agent.get_agent_metadata()  # (it lists the arena: fixed from now on)
                setattr(self, which, arena)
            return arena

    def stage(self, nbytes: int) -> tuple[Arena, int] | None:
        """A staging slot of ``nbytes`` (the arena and the slot's offset), or ``None`` when the arena is full."""
        arena = self._arena("_staging", self.staging_bytes)
        with self._lock:
            offset = arena.alloc(nbytes)
            if offset is None:
                self.allocations += 1
                return None
            self._slots[offset] = _Slot(None, time.time() + UNPUBLISHED_HOLD_S)
            return arena, offset

    def publish(self, array: np.ndarray, expires_at: float) -> PeerRef | None:
        """Give the staging slot that holds ``array`` a transfer id, held until its read or ``expires_at``; ``None``
        if ``array`` is not in a staged slot."""
        with self._lock:
            _, slot = self._slot_of(array)
            if slot is None:
                return None
            slot.transfer_id, slot.expires_at = uuid.uuid4().hex, expires_at
            return PeerRef(self.name, self._metadata, slot.transfer_id)

    def unstage(self, array: np.ndarray) -> bool:
        """Free the staging slot that holds ``array`` if it was never published (its request went away between the
        export and the publish); True if one was freed."""
        with self._lock:
            offset, slot = self._slot_of(array)
            if slot is None or slot.transfer_id is not None:
                return False
            self._free_slot(offset)  # type: ignore[arg-type]  (a slot has an offset)
            return True

    def _slot_of(self, array: np.ndarray) -> tuple[int | None, _Slot | None]:
        """The staging slot holding ``array`` and its offset (under the lock)."""
        offset = self._staging.offset_of(array) if self._staging is not None else None
        return offset, (self._slots.get(offset) if offset is not None else None)

    def _free_slot(self, offset: int) -> None:
        del self._slots[offset]
        self._staging.free(offset)  # type: ignore[union-attr]  (slots exist only with an arena)

    def release(self, now: float | None = None) -> int:
        """Free the slots read (their notification came) or expired; how many are still held."""
        if self._agent is None:
            return 0
        done = {
            msg[5:].decode() for msgs in self._agent.get_new_notifs().values() for msg in msgs if msg[:5] == b"done:"
        }
        now = time.time() if now is None else now
        with self._lock:
            for offset, slot in list(self._slots.items()):
                if slot.transfer_id in done or slot.expires_at <= now:
                    self._free_slot(offset)
            return len(self._slots)

    @property
    def held(self) -> int:
        return len(self._slots)

    # ---- receiving --------------------------------------------------------------------------------------------
    def attach(self, arrays: tuple[np.ndarray, ...]) -> None:
        spans = [(int(a.ctypes.data), int(a.nbytes)) for a in arrays]
        self.register(spans)
        self._attached += spans

    def registered(self, spans: Spans) -> bool:
        """Whether every span lies in memory registered here (an attached pool, the landing arena)."""
        ranges = list(self._attached)
        if self._landing is not None:
            ranges.append((self._landing.address, self._landing.nbytes))
        return all(any(a <= addr and addr + n <= a + size for a, size in ranges) for addr, n in spans)

    def land_slot(self, nbytes: int) -> tuple[Arena, int] | None:
        """A slot of the landing arena (registered on first use), or ``None`` when it is full."""
        arena = self._arena("_landing", LANDING_BYTES)
        with self._lock:
            return None if (offset := arena.alloc(nbytes)) is None else (arena, offset)

    def free_landing(self, offset: int) -> None:
        with self._lock:
            self._landing.free(offset)  # type: ignore[union-attr]

    def read(self, ref: PeerRef, groups: list[tuple[Spans, Spans]], done: Callable[[int], None] | None = None) -> None:
        """READ each group's remote spans into its local ones, one transfer each (each posted before the one before
        it is waited for); ``done(i)`` as group ``i`` completes, in order, and as soon as it has: UCX's cross-memory
        attach copies inside the post, so a group is often complete when its post returns, and reporting it then
        (rather than after the next group's post) lets the caller's work on it overlap the next copy. Then the sender
        is told (``done:<id>``: it frees the slot). Returns only when no transfer is in flight any more, whatever
        happened: the memory must not be handed out while bytes can still arrive in it."""
        agent, peer = self.agent, ref.agent_name
        xfers: list[Any] = []
        deadline = time.monotonic() + self.timeout_s
        reported = 0  # groups reported done, in order

        def report(upto: int, only_finished: bool) -> None:
            nonlocal reported
            while reported < upto:
                if only_finished and agent.check_xfer_state(xfers[reported]) not in ("DONE", "ERR"):
                    return
                self._wait(xfers[reported], deadline)  # (ERR raises here)
                if done is not None:
                    done(reported)
                reported += 1

        try:
            self._peer(ref)
            for i, (local, remote) in enumerate(groups):
                xfers.append(self._post(peer, local, remote))
                report(i, only_finished=False)  # (the one before this one: waited for now, as before)
                report(i + 1, only_finished=True)  # (this one, if its post already moved it)
            report(len(xfers), only_finished=False)
            agent.send_notif(peer, f"done:{ref.transfer_id}".encode())
        except BaseException as exc:
            self._settle(xfers)
            self._forget(peer)  # (a restarted sender, or metadata gone stale: load it afresh next time)
            if isinstance(exc, Exception) and not isinstance(exc, HandoffError):  # NIXL's own: the peer is gone
                raise HandoffLost(f"NIXL read from {peer} failed ({type(exc).__name__})") from exc
            raise
        finally:
            for xfer in xfers:  # (each on its own: one that fails must not hide the read's error or keep the others)
                try:
                    agent.release_xfer_handle(xfer)
                except Exception:
                    log.warning("NIXL transfer handle from %s not released", peer, exc_info=True)

    def _peer(self, ref: PeerRef) -> None:
        version = xxhash.xxh3_64_intdigest(ref.agent_metadata)
        with self._peers_lock:  # (reads run on several threads: one peer is loaded once, not removed mid-load)
            if self._peers.get(ref.agent_name) != version:
                name = self.agent.add_remote_agent(ref.agent_metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != ref.agent_name:
                    raise HandoffError(f"NIXL metadata names agent {name!r}, the hand-off {ref.agent_name!r}")
                self._peers[ref.agent_name] = version

    def _forget(self, peer: str) -> None:
        with self._peers_lock:
            if self._peers.pop(peer, None) is not None:
                try:
                    self.agent.remove_remote_agent(peer)
                except Exception:  # (already gone)
                    pass

    def _post(self, peer: str, local: Spans, remote: Spans) -> Any:
        agent = self.agent
        xfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM"),
            agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM"),
            peer,
        )
        if agent.transfer(xfer) == "ERR":  # (what NIXL answers when the sender is gone)
            agent.release_xfer_handle(xfer)
            raise HandoffLost(f"NIXL read from {peer} could not start")
        return xfer

    def _wait(self, xfer: Any, deadline: float) -> None:
        state = self.agent.check_xfer_state(xfer)
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise HandoffLost(f"NIXL read did not finish in {self.timeout_s}s")
            time.sleep(0.0002)
            state = self.agent.check_xfer_state(xfer)
        if state == "ERR":  # (the sender died, or its connection did, mid-read)
            raise HandoffLost("NIXL read failed")

    def _settle(self, xfers: list[Any]) -> None:
        """Wait (bounded) until none of ``xfers`` is still moving bytes."""
        deadline = time.monotonic() + self.timeout_s
        for xfer in xfers:
            try:
                while self.agent.check_xfer_state(xfer) not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(0.001)
            except Exception:  # (a transfer NIXL already dropped)
                pass
