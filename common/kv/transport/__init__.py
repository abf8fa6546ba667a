"""Transports: how a prefill's KV blocks reach the decode replica, and an encode's visual embeddings the prefill.

Every backend implements :class:`KVTransport` (:mod:`.base` has a hand-off's lifecycle): ``buffers`` / ``publish`` /
``release`` on the sending side, ``attach`` / ``open`` / ``land`` (into the decode pool's blocks) / ``fetch`` on the
receiving side, and ``send_embeddings`` / ``receive_embeddings`` for the encode → prefill hop. Backends, one module
each:

* :mod:`.object_store` — the handle *is* the output; Ray's object store moves it with the stage's response (default).
* :mod:`.nixl` — NIXL agents owned by the replicas (UCX; RDMA where the NIC has it), memory registered once
  (:mod:`.nixl_agent`): the handle is a small descriptor, the receiver READs straight into its pool's blocks.
* :mod:`.in_process` — between stages that share a replica (a grouped topology): the output itself, one copy.
* :mod:`.fake` — in-process, for tests: the KV crosses as wire bytes, and faults can be injected per hand-off.
"""

from __future__ import annotations

from common.kv.transport.base import KVTransport, TransportName


def make_transport(name: TransportName) -> KVTransport:
    """The backend a config names (a model's ``transport``, else ``server.transport``); NIXL is imported only when
    asked for."""
    if name == "object_store":
        from common.kv.transport.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if name == "nixl":
        from common.kv.transport.nixl import NixlTransport

        return NixlTransport()
    if name == "in_process":
        from common.kv.transport.in_process import InProcessTransport

        return InProcessTransport()
    if name == "fake":
        from common.kv.transport.fake import FakeTransport

        return FakeTransport()
    raise ValueError(f"unknown KV transport {name!r}")


__all__ = ["KVTransport", "TransportName", "make_transport"]
