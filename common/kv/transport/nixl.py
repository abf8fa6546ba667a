"""Hand-offs over NIXL (RDMA where the hardware has it; UCX over shared memory/TCP on CPU machines).

Serve replicas are actors Serve creates, so Ray Direct Transport cannot be attached to them; instead each replica
owns a NIXL agent (:class:`common.kv.transport.nixl_agent.Agent`), and the handle that travels through the normal
Serve call is small. Memory is registered once per replica, never per hand-off.

**KV** (prefill → decode):

* the prefill engine exports each hand-off's KV straight into a slot of the replica's staging arena
  (:meth:`NixlTransport.buffers`: the export's one permuting copy is the only one on this side); ``publish`` returns
  a :class:`RemotePrefillOutput` — the prefill's fields, the KV's :class:`KVLayout`, the agent's name and metadata,
  the slot's addresses and a transfer id. A hand-off that found the arena full was exported into fresh arrays and
  travels by value instead (the object store carries it), counted in :attr:`NixlTransport.allocations`.
* the decode replica registers its KV pool once (:meth:`NixlTransport.attach`); ``land`` READs the hand-off
  straight into the pool blocks the sequence was given — one descriptor per array, layer and run of blocks
  (:class:`common.kv.landing.Landing`), as transfers of about :data:`GROUP_BYTES` — and hashes each transfer's bytes
  where they landed as soon as it is done, while they are still in cache and the next one moves
  (:class:`common.kv.hash_behind.HashBehind`: a C loop on the hashing thread that never waits for the GIL, which
  NIXL's ``transfer()`` holds while UCX's cross-memory attach copies inside it): the seal's check costs about the
  last group's hash.
* Why READ and not WRITE: the receiver knows where the blocks are when the hand-off arrives, and nothing about it
  has to travel to the sender — a reservation's answer stays a replica id, a sequence without a reservation (a
  migration, ``reserve_kv`` off) lands the same way in blocks leased on arrival, and a receiver that died
  mid-transfer leaves the sender nothing to undo but a slot its deadline frees.
* ``fetch`` (a sequence whose lease must wait: the KV comes here as arrays, copied in when the lease comes) reads into
  the landing arena, or — past it — into arrays allocated and registered for the one hand-off (counted).

**Visual embeddings** (encode → prefill): :meth:`NixlTransport.send_embeddings` copies each item into a staging slot
(the encoder cache keeps its own arrays) and sends a :class:`RemoteEmbeddings` with their checksum
(:mod:`common.kv.digest`); :meth:`NixlTransport.receive_embeddings` READs them into a slot of the prefill replica's
landing arena, checks the digest there, and hands back views of it that the prefill's merge consumes — the slot is
freed once merged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import HandoffError, RevisionMismatch
from common.kv import hash_behind
from common.kv.blocks import fresh_buffers
from common.kv.digest import SCHEME, digest
from common.kv.landing import Landing
from common.kv.transport.base import KVTransport, Received
from common.kv.transport.nixl_agent import STAGING_BYTES, Agent, PeerRef, Spans
from common.protocol.handoff import (
    FirstToken,
    KVBlocks,
    KVLayout,
    Prefilled,
    PrefillOutput,
    TokenLogprob,
    VisualEmbeddings,
)

GROUP_BYTES = 4 << 20
"""About how many bytes each of a landing's transfers moves (a KV of a few MB goes as one). Small enough that a group
is hashed from cache while the next one moves; large enough that the post's own cost (a few tens of µs) is noise.
256 MB landed into a pool, 2-core AMD EPYC Zen 4, against UCX's own READ of the same size in the same run (the
parts of ``loadtest/bench_transfer.py`` in a driver of their own, 5–7 repeats; repeats spread widely on that host):
0.80–0.83 with 4 or 8 MB groups, 0.77 with 16, 0.71 with 32; before the C loop, 0.53–0.78 with 16."""


HASH_THREADS = 4
"""Landings hashed behind their transfers at once; one past that is hashed by its own thread once it has landed."""


@dataclass(frozen=True)
class RemoteKV:
    peer: PeerRef
    keys_addr: int
    values_addr: int
    layout: KVLayout


@dataclass(frozen=True)
class RemotePrefillOutput:
    """A :class:`PrefillOutput` whose KV stays in the sender's staging arena until the receiver reads it."""

    prompt_token_ids: np.ndarray
    first_token_id: int
    kv: RemoteKV
    rope_delta: int
    model_revision: str
    request_key: str = ""
    checksum: int = -1
    checksum_scheme: str = ""
    first_logprob: TokenLogprob | None = None
    forks: tuple[FirstToken, ...] = ()

    @property
    def layout(self) -> KVLayout:
        return self.kv.layout


@dataclass(frozen=True)
class RemoteItem:
    """One :class:`VisualEmbeddings` whose array stays in the sender's staging arena."""

    fields: VisualEmbeddings
    """The item with an empty array in place of its embeddings (what it is, not its bytes)."""
    addr: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RemoteEmbeddings:
    peer: PeerRef
    items: tuple[RemoteItem, ...]
    checksum: int
    """The hand-off checksum of the items' bytes, in order (:func:`common.kv.digest.digest`)."""
    scheme: str = ""
    """Which checksum (:data:`common.kv.digest.SCHEME`; ``""``: code before it had a name)."""

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(i.shape)) * np.dtype(i.dtype).itemsize for i in self.items)


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, agent_name: str | None = None, timeout_s: float = 30.0, staging_bytes: int = STAGING_BYTES):
        self.agent = Agent(agent_name, timeout_s, staging_bytes)
        # (a landing's hash loop holds a thread while its transfer lasts: a few, for landings that overlap)
        self._hasher = ThreadPoolExecutor(HASH_THREADS, "prism-nixl-hash")

    def prepare(self, sends: bool = True, receives: bool = True) -> None:
        super().prepare(sends, receives)  # (a hand-off sent by value lands through the copy loop)
        self.agent.prepare(sends, receives)
        if receives:
            hash_behind.warm()  # (the landing's hash loop built now, not on the first hand-off)

    @property
    def registrations(self) -> int:
        return self.agent.registrations

    @property
    def allocations(self) -> int:
        return self.agent.allocations

    # ---- sender ---------------------------------------------------------------------------------------------
    def buffers(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        staged = self.agent.stage(2 * nbytes)
        if staged is None:
            return fresh_buffers(shape, dtype)
        arena, offset = staged
        return arena.view(offset, shape, dtype), arena.view(offset + nbytes, shape, dtype)

    def publish(self, out: PrefillOutput, expires_at: float) -> RemotePrefillOutput | PrefillOutput:
        kv = out.kv
        peer = self.agent.publish(kv.keys, expires_at)
        if peer is None:  # exported into fresh arrays (the arena was full): it travels by value
            return out
        remote = RemoteKV(peer, int(kv.keys.ctypes.data), int(kv.values.ctypes.data), kv.layout)
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        return RemotePrefillOutput(**{**fields, "kv": remote})

    def send_embeddings(self, items: list[VisualEmbeddings], expires_at: float) -> Any:
        nbytes = sum(int(i.embeddings.nbytes) for i in items)
        staged = self.agent.stage(nbytes) if nbytes else None
        if staged is None:
            return items  # (nothing to send, or the arena is full: by value)
        arena, offset = staged
        remote, at = [], offset
        for item in items:
            view = arena.view(at, item.embeddings.shape, item.embeddings.dtype)
            view[...] = item.embeddings
            empty = np.empty((0, *item.embeddings.shape[1:]), item.embeddings.dtype)
            fields = dataclasses.replace(item, embeddings=empty)
            remote.append(RemoteItem(fields, int(view.ctypes.data), tuple(view.shape), str(view.dtype)))
            at += int(view.nbytes)
        peer = self.agent.publish(arena.view(offset, (nbytes,), np.uint8), expires_at)
        assert peer is not None  # staged just now
        checksum = digest([arena.view(offset, (nbytes,), np.uint8)])
        return RemoteEmbeddings(peer, tuple(remote), checksum, SCHEME)

    def discard(self, out: PrefillOutput) -> None:
        self.agent.unstage(out.kv.keys)

    def release(self, now: float | None = None) -> int:
        return self.agent.release(now)

    @property
    def held(self) -> int:
        return self.agent.held

    # ---- receiver -------------------------------------------------------------------------------------------
    def attach(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.agent.attach(arrays)

    def open(self, handle: object) -> Prefilled:
        if not isinstance(handle, (RemotePrefillOutput, PrefillOutput)):
            raise HandoffError(f"received a {type(handle).__name__} KV handle but this replica's transport is nixl")
        return handle

    def land(self, pre: Prefilled, landing: Landing) -> int:
        if isinstance(pre, PrefillOutput):  # sent by value (its sender's arena was full): copied like the store's
            return super().land(pre, landing)
        assert isinstance(pre, RemotePrefillOutput)
        local = list(landing.destinations())
        spans = [(int(d.ctypes.data), int(d.nbytes)) for d in local]
        if not self.agent.registered(spans):
            raise HandoffError("a NIXL landing outside the receiver's registered pool")
        bases = (pre.kv.keys_addr, pre.kv.values_addr)
        remote = [(bases[array] + offset, n) for array, offset, n in landing.remote_pieces()]
        groups = _groups([n for _, n in spans], GROUP_BYTES)
        # (the hash loop waits at most twice as long as the read does for its transfers)
        hashed = hash_behind.HashBehind(local, self._hasher, 2 * self.agent.timeout_s)
        try:
            self.agent.read(
                pre.kv.peer,
                [([spans[i] for i in g], [remote[i] for i in g]) for g in groups],
                lambda group: hashed.landed(groups[group][-1] + 1),  # (groups are consecutive spans)
            )
        except BaseException:
            hashed.abort()  # (nothing of ours reads the blocks once we return)
            raise
        return hashed.intdigest()

    def fetch(self, pre: Prefilled) -> PrefillOutput:
        if isinstance(pre, PrefillOutput):
            return pre
        assert isinstance(pre, RemotePrefillOutput)
        layout, kv = pre.layout, pre.kv
        half = layout.nbytes // 2
        flat, free = self._read_flat(kv.peer, [(kv.keys_addr, half), (kv.values_addr, half)])
        try:  # (copied out: the sequence waits for its lease with them, the landing slot goes back now)
            keys = flat[:half].view(layout.numpy_dtype).reshape(layout.shape).copy()
            values = flat[half:].view(layout.numpy_dtype).reshape(layout.shape).copy()
            self.agent.allocations += 1
        finally:
            free()
        blocks = KVBlocks(layout.block_size, layout.num_tokens, layout.dtype, keys, values)
        fields = {f.name: getattr(pre, f.name) for f in dataclasses.fields(pre)}
        return PrefillOutput(**{**fields, "kv": blocks})

    def receive_embeddings(self, handle: Any) -> Received:
        if not isinstance(handle, RemoteEmbeddings):
            return super().receive_embeddings(handle)
        sizes = [int(np.prod(i.shape)) * np.dtype(i.dtype).itemsize for i in handle.items]
        flat, free = self._read_flat(handle.peer, [(i.addr, n) for i, n in zip(handle.items, sizes, strict=True)])
        try:
            if handle.scheme != SCHEME:  # (checked once read: the read is what frees the sender's slot)
                raise RevisionMismatch(f"embeddings checksummed as {handle.scheme!r}; this replica checks {SCHEME!r}")
            if digest([flat]) != handle.checksum:
                raise HandoffError("visual embeddings corrupted: their bytes do not match the encoder's checksum")
            items, at = [], 0
            for item, n in zip(handle.items, sizes, strict=True):
                array = flat[at : at + n].view(item.dtype).reshape(item.shape)
                items.append(dataclasses.replace(item.fields, embeddings=array))
                at += n
        except BaseException:
            free()
            raise
        return items, free

    def _read_flat(self, peer: PeerRef, remote: Spans) -> tuple[np.ndarray, Callable[[], None]]:
        """The remote spans READ, in order, into one flat region — a slot of the landing arena, or (past it) an
        array registered for this one read — and how to give it back."""
        agent, nbytes = self.agent, sum(n for _, n in remote)
        slot = agent.land_slot(nbytes)
        if slot is not None:
            arena, offset = slot
            flat = arena.view(offset, (nbytes,), np.uint8)

            def free() -> None:
                agent.free_landing(offset)

        else:
            flat = np.empty(nbytes, np.uint8)
            agent.allocations += 1
            reg = agent.register([(int(flat.ctypes.data), nbytes)])

            def free() -> None:
                agent.deregister(reg)

        local, at = [], int(flat.ctypes.data)
        for _, n in remote:
            local.append((at, n))
            at += n
        try:
            agent.read(peer, [(local, remote)])
        except BaseException:
            free()
            raise
        return flat, free


def _groups(sizes: list[int], target: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` cut into groups of about ``target`` bytes (at least one, none empty)."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > target:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups
