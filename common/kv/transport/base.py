"""The interface every KV transport backend implements (see :mod:`common.kv.transport`).

Lifecycle of one hand-off: the sender ``publish``-es the prefill's output and returns a *handle* — the value that
rides in the prefill stage's response to the decode stage; the receiver ``fetch``-es the handle into a
:class:`PrefillOutput` (validated by the decode engine like any other); the sender's ``release`` frees buffers that
were read or whose ``expires_at`` (the request's deadline) passed, so an abandoned request cannot pin memory. A
handle from another backend, or one that cannot be read, raises :class:`HandoffError` — never a half-built output.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from common.protocol.handoff import PrefillOutput

TransportName = Literal["object_store", "nixl", "fake"]


class KVTransport(abc.ABC):
    name: TransportName
    fetch_blocks: bool = True
    """Whether :meth:`fetch` does I/O (run it in a worker thread) or just hands back what arrived (call it inline)."""

    @abc.abstractmethod
    def publish(self, out: PrefillOutput, expires_at: float) -> Any:
        """Make ``out`` readable by a receiver until ``expires_at`` (wall clock); returns the handle to send."""

    @abc.abstractmethod
    def fetch(self, handle: Any) -> PrefillOutput:
        """The output behind ``handle`` (blocking when :attr:`fetch_blocks`); raises :class:`HandoffError`."""

    def release(self, now: float | None = None) -> int:
        """Free what was read or expired; returns how many hand-offs the sender still holds."""
        return 0

    @property
    def held(self) -> int:
        """Hand-offs published and not yet released."""
        return 0
