"""The default KV transport: the handle is the :class:`PrefillOutput` itself.

The prefill stage returns it as its Serve response and the decode stage receives it as an argument, so the Ray
object store carries the numpy blocks replica to replica (zero-copy through shared memory on one node). Nothing is
held by the sender: Ray frees the object when the last reference goes.
"""

from __future__ import annotations

from common.errors import HandoffError
from common.kv.transport.base import KVTransport
from common.protocol.handoff import PrefillOutput


class ObjectStoreTransport(KVTransport):
    name = "object_store"
    fetch_blocks = False  # Serve already resolved the response into the argument: nothing to wait for

    def publish(self, out: PrefillOutput, expires_at: float) -> PrefillOutput:
        return out

    def fetch(self, handle: object) -> PrefillOutput:
        if not isinstance(handle, PrefillOutput):
            raise HandoffError(
                f"received a {type(handle).__name__} KV handle but this replica's transport is object_store"
            )
        return handle
