"""KV transport over NIXL (RDMA where the hardware has it; UCX over shared memory/TCP on CPU machines).

Serve replicas are actors Serve creates, so Ray Direct Transport cannot be attached to them; instead each replica
owns a NIXL agent (made on first use), and the handle that travels through the normal Serve call is tiny:

1. ``publish`` (prefill) registers the KV arrays with the agent and returns a :class:`RemotePrefillOutput` — the
   agent's name and metadata, the arrays' addresses/sizes/shapes, and a transfer id — instead of the arrays.
2. ``fetch`` (decode) loads the sender's agent metadata (refreshed per hand-off: it lists the sender's registered
   memory), allocates and registers destination arrays, and READs both arrays in one transfer whose notification
   (``done:<id>``) reaches the sender on completion.
3. ``release`` (sender) deregisters the buffers whose notification arrived or whose hand-off expired (the request's
   deadline), so an abandoned request cannot pin memory.

NIXL registers numpy memory as ``(address, nbytes, device 0, "")`` in ``DRAM``. The receiver's output is validated
exactly like object-store blocks by the decode engine (:func:`common.kv.blocks.check_prefill`).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import HandoffError
from common.kv.transport.base import KVTransport
from common.protocol.handoff import KVBlocks, PrefillOutput


@dataclass(frozen=True)
class RemoteKV:
    agent_name: str
    agent_metadata: bytes
    transfer_id: str
    keys_addr: int
    values_addr: int
    nbytes: int
    shape: tuple[int, ...]
    numpy_dtype: str
    dtype: str
    block_size: int
    num_tokens: int


@dataclass(frozen=True)
class RemotePrefillOutput:
    """A :class:`PrefillOutput` whose KV stays in the sender's memory until the receiver reads it."""

    prompt_token_ids: np.ndarray
    first_token_id: int
    kv: RemoteKV
    rope_delta: int
    model_revision: str
    request_key: str = ""
    checksum: int = -1


def new_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config  # imported lazily: only replicas using NIXL pay for it

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, agent_name: str | None = None, timeout_s: float = 30.0) -> None:
        self.agent_name = agent_name or f"prism-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self._agent: Any = None
        self._lock = threading.Lock()
        self._held: dict[str, tuple[KVBlocks, Any, float]] = {}

    @property
    def agent(self) -> Any:
        with self._lock:
            if self._agent is None:
                self._agent = new_agent(self.agent_name)
            return self._agent

    # ---- sender ---------------------------------------------------------------------------------------------
    def publish(self, out: PrefillOutput, expires_at: float) -> RemotePrefillOutput:
        kv = out.kv
        keys, values = np.ascontiguousarray(kv.keys), np.ascontiguousarray(kv.values)
        agent = self.agent
        reg = agent.register_memory(
            [(keys.ctypes.data, keys.nbytes, 0, ""), (values.ctypes.data, values.nbytes, 0, "")], "DRAM"
        )
        tid = uuid.uuid4().hex
        with self._lock:
            self._held[tid] = (KVBlocks(kv.block_size, kv.num_tokens, kv.dtype, keys, values), reg, expires_at)
        remote = RemoteKV(
            agent_name=self.agent_name,
            agent_metadata=agent.get_agent_metadata(),
            transfer_id=tid,
            keys_addr=keys.ctypes.data,
            values_addr=values.ctypes.data,
            nbytes=keys.nbytes,
            shape=tuple(keys.shape),
            numpy_dtype=str(keys.dtype),
            dtype=kv.dtype,
            block_size=kv.block_size,
            num_tokens=kv.num_tokens,
        )
        return RemotePrefillOutput(
            out.prompt_token_ids,
            out.first_token_id,
            remote,
            out.rope_delta,
            out.model_revision,
            out.request_key,
            out.checksum,
        )

    def release(self, now: float | None = None) -> int:
        if self._agent is None:  # nothing was ever published
            return 0
        done = set()
        for messages in self._agent.get_new_notifs().values():
            for msg in messages:
                if msg.startswith(b"done:"):
                    done.add(msg[5:].decode())
        now = time.time() if now is None else now
        with self._lock:
            for tid, (_, reg, expires) in list(self._held.items()):
                if tid in done or expires <= now:
                    self._agent.deregister_memory(reg)
                    del self._held[tid]
            return len(self._held)

    @property
    def held(self) -> int:
        return len(self._held)

    # ---- receiver -------------------------------------------------------------------------------------------
    def fetch(self, handle: object) -> PrefillOutput:
        if not isinstance(handle, RemotePrefillOutput):
            raise HandoffError(f"received a {type(handle).__name__} KV handle but this replica's transport is nixl")
        ref, agent = handle.kv, self.agent
        # The sender's metadata describes its registered memory, which changes with every publish: load it each
        # time (NIXL updates a known agent in place).
        peer = agent.add_remote_agent(ref.agent_metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        keys = np.empty(ref.shape, dtype=np.dtype(ref.numpy_dtype))
        values = np.empty_like(keys)
        if keys.nbytes != ref.nbytes:
            raise HandoffError("NIXL KV descriptor size does not match its shape")
        local = [(keys.ctypes.data, keys.nbytes, 0, ""), (values.ctypes.data, values.nbytes, 0, "")]
        reg = agent.register_memory(local, "DRAM")
        xfer = None
        try:
            xfer = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([d[:3] for d in local], "DRAM"),
                agent.get_xfer_descs([(ref.keys_addr, ref.nbytes, 0), (ref.values_addr, ref.nbytes, 0)], "DRAM"),
                peer,
                f"done:{ref.transfer_id}".encode(),
            )
            self._wait(xfer)
        finally:
            if xfer is not None:
                agent.release_xfer_handle(xfer)
            agent.deregister_memory(reg)
        kv = KVBlocks(ref.block_size, ref.num_tokens, ref.dtype, keys, values)
        return PrefillOutput(
            handle.prompt_token_ids,
            handle.first_token_id,
            kv,
            handle.rope_delta,
            handle.model_revision,
            handle.request_key,
            handle.checksum,
        )

    def _wait(self, xfer: Any) -> None:
        state = self.agent.transfer(xfer)
        deadline = time.monotonic() + self.timeout_s
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise HandoffError(f"NIXL KV read did not finish in {self.timeout_s}s")
            time.sleep(0.0005)
            state = self.agent.check_xfer_state(xfer)
        if state == "ERR":
            raise HandoffError("NIXL KV read failed")
