"""KV transports: how a prefill's KV blocks reach the decode replica.

Every backend implements :class:`KVTransport` — ``publish`` on the sending side (prefill) turns a
:class:`PrefillOutput` into the handle that travels through the normal stage call, ``fetch`` on the receiving side
(decode) turns the handle back into a :class:`PrefillOutput`, ``release`` frees what the sender still holds once
it was read or its request's deadline passed. Backends, one module each:

* :mod:`.object_store` — the handle *is* the output; Ray's object store moves it with the stage's response (default).
* :mod:`.nixl` — NIXL agents owned by the replicas (UCX; RDMA where the NIC has it): the handle is a small descriptor.
* :mod:`.fake` — in-process, for tests: the KV crosses as wire bytes, and faults can be injected per hand-off.
"""

from __future__ import annotations

from common.kv.transport.base import KVTransport, TransportName


def make_transport(name: TransportName) -> KVTransport:
    """The backend a config names (``server.transport``); NIXL is imported only when asked for."""
    if name == "object_store":
        from common.kv.transport.object_store import ObjectStoreTransport

        return ObjectStoreTransport()
    if name == "nixl":
        from common.kv.transport.nixl import NixlTransport

        return NixlTransport()
    if name == "fake":
        from common.kv.transport.fake import FakeTransport

        return FakeTransport()
    raise ValueError(f"unknown KV transport {name!r}")


__all__ = ["KVTransport", "TransportName", "make_transport"]
