"""The default KV transport: the handle is the :class:`PrefillOutput` itself.

The prefill stage returns it as its Serve response and the decode stage receives it as an argument, so the Ray
object store carries the numpy blocks replica to replica: Serve's serialisation copies them into the store (copy one);
the decode stage gets read-only views of the store's shared memory, and :meth:`KVTransport.land` copies those views
straight into the pool blocks the sequence was given, hashing each piece as it is written (copy two, the integrity
check riding on it: :func:`common.kv.digest.copy_digest`). Nothing is held by the sender: Ray frees the object when
the last reference goes.
"""

from __future__ import annotations

from common.errors import HandoffError
from common.kv.transport.base import KVTransport
from common.protocol.handoff import PrefillOutput


class ObjectStoreTransport(KVTransport):
    name = "object_store"
    lands_from_memory = True  # (the store's shared memory is mapped here already)

    def publish(self, out: PrefillOutput, expires_at: float) -> PrefillOutput:
        return out

    def open(self, handle: object) -> PrefillOutput:
        if not isinstance(handle, PrefillOutput):
            raise HandoffError(
                f"received a {type(handle).__name__} KV handle but this replica's transport is {self.name}"
            )
        return handle
