"""The hand-off between two stages that share a replica (a grouped deployment, :mod:`common.config.topology`).

The handle is the output itself, as with the object store, but it never leaves the process: the prefill's exported
KV is copied once, into the decode pool's blocks the sequence was given (hashing as it writes, so the seal is checked
on the bytes where they lie, as on every path), and the visual embeddings go to prefill as the encoder made them.
Nothing is serialised and nothing is held by the sender. Named ``in_process`` in traces and metrics, so a grouped
hop shows as what it is.
"""

from __future__ import annotations

from common.kv.transport.object_store import ObjectStoreTransport


class InProcessTransport(ObjectStoreTransport):
    name = "in_process"
