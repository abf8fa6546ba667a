"""An in-process KV transport for tests, with fault injection.

The sender encodes the :class:`PrefillOutput` to wire bytes (:mod:`common.protocol.wire`: no pickle) and keeps them
under a transfer id; the handle is that id. The receiver's :meth:`FakeTransport.open` decodes the bytes — so a test
through this backend proves the hand-off survives a byte boundary, as NIXL's or a file's would — and marks the
hand-off read, which ``release`` then frees (or expiry, like NIXL); it lands by copying into the pool like the object
store. Faults queued with :meth:`FakeTransport.inject` apply to the next opens, one each: ``lose`` (the sender's copy
is gone: a replica died or the hand-off expired), ``truncate`` (half the bytes arrive), ``delay`` (the read takes
``delay_s``), ``corrupt`` (one KV value arrives altered, shape and dtype intact: a bad copy, or a sender buffer reused
before the read) and ``stale`` (another attempt's hand-off arrives: its request key differs). ``lose`` and
``truncate`` raise here — :class:`HandoffLost` (the ingress issues the chain again, as for a lost replica) and
:class:`HandoffError`; ``corrupt`` and ``stale`` decode cleanly and must be caught by the
receiver (the seal's checks: :mod:`common.kv.blocks`)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from common.errors import HandoffError, HandoffLost
from common.kv.transport.base import KVTransport
from common.protocol.handoff import PrefillOutput
from common.protocol.wire import from_bytes, to_bytes

Fault = Literal["lose", "truncate", "delay", "corrupt", "stale"]


@dataclass(frozen=True)
class FakeHandle:
    transfer_id: str
    nbytes: int


class FakeTransport(KVTransport):
    name = "fake"

    def __init__(self, clock: Callable[[], float] = time.time, delay_s: float = 0.05) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.faults: deque[Fault] = deque()
        self.fetches = 0
        self._lock = threading.Lock()
        self._held: dict[str, tuple[bytes, float, bool]] = {}  # id → (bytes, expires_at, read)

    def inject(self, *faults: Fault) -> None:
        """Queue faults for the next opens (one fault per hand-off, in order)."""
        self.faults.extend(faults)

    def publish(self, out: PrefillOutput, expires_at: float) -> FakeHandle:
        data = to_bytes(out)
        tid = uuid.uuid4().hex
        with self._lock:
            self._held[tid] = (data, expires_at, False)
        return FakeHandle(tid, len(data))

    open_blocks = True  # (it decodes the wire bytes)

    def open(self, handle: object) -> PrefillOutput:
        if not isinstance(handle, FakeHandle):
            raise HandoffError(f"received a {type(handle).__name__} KV handle but this replica's transport is fake")
        fault = self.faults.popleft() if self.faults else None
        self.fetches += 1
        with self._lock:
            held = self._held.get(handle.transfer_id)
            if fault == "lose" and held is not None:
                del self._held[handle.transfer_id]
                held = None
        if held is None:
            raise HandoffLost("the KV hand-off is gone (sender lost or hand-off expired)")
        data = held[0]
        if fault == "truncate":
            data = data[: len(data) // 2]
        elif fault == "delay":
            time.sleep(self.delay_s)
        out = from_bytes(PrefillOutput, data)  # HandoffError on anything that does not decode
        if fault == "corrupt":
            keys = out.kv.keys.copy()
            keys.reshape(-1).view(np.uint8)[0] ^= 0x40  # one bit of one value
            out = dataclasses.replace(out, kv=dataclasses.replace(out.kv, keys=keys))
        elif fault == "stale":
            out = dataclasses.replace(out, request_key=out.request_key + "#earlier")
        with self._lock:
            if handle.transfer_id in self._held:
                self._held[handle.transfer_id] = (held[0], held[1], True)
        return out

    def release(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        with self._lock:
            for tid, (_, expires, read) in list(self._held.items()):
                if read or expires <= now:
                    del self._held[tid]
            return len(self._held)

    @property
    def held(self) -> int:
        return len(self._held)
