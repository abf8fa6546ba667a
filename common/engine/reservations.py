"""KV reservations of the decode engine: a sequence's lease taken before prefill computes it.

The decode stage may take a sequence's lease before prefill computes it — :meth:`Reservations.reserve` under the
attempt's key, with the blocks the request is known to need — so a full pool holds the request back before any
prefill work, not after. The sequence's ``submit`` (or ``claim``) then *claims* the lease: resized to the exact need
(:meth:`KVPool.resize_lease`: more than it holds may have to wait), admitted at once when granted. A reservation
nobody claims is dropped by :meth:`Reservations.unreserve` (the chain failed or was cancelled before decode) or when
its deadline passes (:meth:`Reservations.expire_reservations`).

A mixin of :class:`common.engine.decode.DecodeEngine`, which owns the state it reads: ``pool``, ``clock``,
``_reserved`` (attempt key → deadline), ``_pending`` (sequences waiting for a lease), ``_check_new`` and ``_release``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.kv.pool import KVPool


class Reservations:
    pool: KVPool
    clock: Callable[[], float]
    _reserved: dict[str, float | None]
    _pending: Any

    def _check_new(self, request_id: str) -> None:  # (the engine's)
        raise NotImplementedError

    def _release(self, request_id: str) -> None:  # (the engine's)
        raise NotImplementedError

    def expire_waiting(self) -> None:  # (the engine's)
        raise NotImplementedError

    def reserve(
        self,
        request_id: str,
        blocks: int,
        deadline: float | None = None,
        rank: float | None = None,
        tenant: str = "",
        weight: float = 1.0,
        batch: bool = False,
    ) -> bool:
        """Take (or queue as ``tenant``'s, by ``rank``: :meth:`KVPool.request_lease`) a lease of ``blocks`` for a
        sequence not prefilled yet; True if granted now. Raises :class:`LeaseTooLarge` past the per-request limit."""
        if request_id in self._reserved:
            raise ValueError(f"request {request_id} is already known to this engine")
        self._check_new(request_id)
        granted = self.pool.request_lease(request_id, blocks, rank, tenant, weight, batch) is not None
        self._reserved[request_id] = deadline
        return granted

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def hold(self, request_id: str, until: float) -> None:
        """Let an unclaimed reservation lapse at ``until`` (this engine's clock) if its deadline is later."""
        if request_id in self._reserved:
            deadline = self._reserved[request_id]
            self._reserved[request_id] = until if deadline is None else min(deadline, until)

    def reservation_granted(self, request_id: str) -> bool:
        return request_id in self._reserved and self.pool.granted(request_id)

    def unreserve(self, request_id: str) -> bool:
        """Drop a reservation no submit claimed (its blocks go to whoever waits); False if there is none."""
        if self._reserved.pop(request_id, False) is False:
            return False
        self._release(request_id)
        return True

    def expire_reservations(self) -> list[str]:
        """Drop the unclaimed reservations whose deadline passed; returns their ids."""
        now = self.clock()
        expired = [rid for rid, dl in self._reserved.items() if dl is not None and dl <= now]
        for rid in expired:
            self.unreserve(rid)
        return expired

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def expire_leases(self) -> None:
        """What the decode stage's sweep runs (:class:`common.admission.kv.KVGate`): unclaimed reservations past their
        deadline dropped, sequences that waited for their lease past theirs timed out."""
        self.expire_reservations()
        self.expire_waiting()

    @property
    def leases_pending(self) -> bool:
        """Reservations held or sequences waiting for a lease: what the sweep watches."""
        return bool(self._reserved or self._pending)
