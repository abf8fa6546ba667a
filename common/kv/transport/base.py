"""The interface every KV transport backend implements (see :mod:`common.kv.transport`).

Lifecycle of one hand-off:

* sender (prefill): the engine exports the KV into :meth:`KVTransport.buffers` (a slot of a region the transport
  registered once, or fresh arrays), the stage seals it and :meth:`KVTransport.publish`\\ es it: the *handle* that
  rides in the prefill stage's response to the decode stage. :meth:`KVTransport.release` frees what receivers have
  read, or whose ``expires_at`` (the request's deadline) passed, so an abandoned request cannot pin memory.
* visual embeddings (encode → prefill) go the same way: :meth:`KVTransport.send_embeddings` on the encode side,
  :meth:`KVTransport.receive_embeddings` on the prefill side, which also says how to free their memory once merged.
* receiver (decode): :meth:`KVTransport.attach` once, at start, with the pool's arrays (a transport that moves bytes
  into registered memory registers them there, once); per hand-off :meth:`KVTransport.open` gives the
  :class:`Prefilled` behind the handle — checked and leased for before any KV byte moves — then either
  :meth:`KVTransport.land` moves its KV straight into the pool blocks the sequence was given
  (:class:`common.kv.landing.Landing`) and returns the digest of what landed, or, when no blocks can be had at
  once, :meth:`KVTransport.fetch` brings it here as arrays (the engine copies them in when the lease comes).

A handle from another backend, or one that cannot be read, raises :class:`HandoffError` — never a half-built output.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from common.errors import HandoffError
from common.kv import xxh3
from common.kv.blocks import fresh_buffers
from common.kv.digest import copy_digest
from common.kv.landing import Landing
from common.protocol.handoff import Prefilled, PrefillOutput, VisualEmbeddings

TransportName = Literal["object_store", "nixl", "fake", "in_process"]
Received = tuple[list[VisualEmbeddings], Callable[[], None]]
"""Visual embeddings as a receiver holds them, and what gives back the memory they lie in once they are consumed."""


def _nothing() -> None:
    return None


class KVTransport(abc.ABC):
    name: TransportName
    open_blocks: bool = False
    """Whether :meth:`open` does I/O (run it in a worker thread) or just checks what arrived (call it inline)."""
    lands_from_memory: bool = False
    """Whether :meth:`land` only copies bytes already in this process's memory (no peer to wait on): a small
    hand-off may then land inline, where a worker thread's round trip would cost more than the copy."""

    def prepare(self, sends: bool = True, receives: bool = True) -> None:
        """Make at the replica's start what the first hand-off would otherwise make on a request's time (NIXL: the
        agent — ~0.5 s here — and the registered arenas of the replica's roles: it ``sends`` hand-offs, it
        ``receives`` them); a receiver's land loop (:func:`common.kv.xxh3.warm`: built once per machine)."""
        if receives:
            xxh3.warm()

    # ---- sender ---------------------------------------------------------------------------------------------------
    def buffers(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Where the engine exports a hand-off's keys and values (both ``shape``): fresh arrays by default."""
        return fresh_buffers(shape, dtype)

    @abc.abstractmethod
    def publish(self, out: PrefillOutput, expires_at: float) -> Any:
        """Make ``out`` readable by a receiver until ``expires_at`` (wall clock); returns the handle to send."""

    def send_embeddings(self, items: list[VisualEmbeddings], expires_at: float) -> Any:
        """The handle of an encode stage's ``items`` (by default the items themselves: the object store carries
        them with the response)."""
        return items

    def discard(self, out: PrefillOutput) -> None:
        """``out`` was exported into this transport's :meth:`buffers` but will never be published (its caller went
        away): give its memory back now rather than when it lapses."""
        return None

    def release(self, now: float | None = None) -> int:
        """Free what was read or expired; returns how many hand-offs the sender still holds."""
        return 0

    @property
    def held(self) -> int:
        """Hand-offs published and not yet released."""
        return 0

    # ---- receiver -------------------------------------------------------------------------------------------------
    def attach(self, arrays: tuple[np.ndarray, ...]) -> None:
        """The receiver's pool (keys and values), once, before any hand-off lands in it (nothing to do for a
        transport that copies)."""
        return None

    @abc.abstractmethod
    def open(self, handle: Any) -> Prefilled:
        """The prefill result behind ``handle``: its fields and KV layout, its bytes wherever the backend keeps them."""

    def receive_embeddings(self, handle: Any) -> Received:
        """The visual embeddings behind ``handle`` (blocking when their bytes are elsewhere), and what frees their
        memory once the prefill has merged them."""
        if not isinstance(handle, list) or not all(isinstance(i, VisualEmbeddings) for i in handle):
            raise HandoffError(f"received {type(handle).__name__} embeddings; this replica's transport is {self.name}")
        return handle, _nothing

    def land(self, pre: Prefilled, landing: Landing) -> int:
        """Move ``pre``'s KV into the pool pieces of ``landing``; the checksum of the bytes as they lie there."""
        out = self.fetch(pre)
        return copy_digest(landing.pairs(out.kv.keys, out.kv.values))

    def fetch(self, pre: Prefilled) -> PrefillOutput:
        """``pre`` with its KV as arrays in this process (blocking when the bytes are elsewhere)."""
        if not isinstance(pre, PrefillOutput):
            raise TypeError(f"{type(self).__name__} cannot fetch a {type(pre).__name__}")
        return pre
