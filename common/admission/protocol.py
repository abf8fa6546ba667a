"""The one protocol every admission gate speaks: ``acquire`` an amount of a stage's capacity, ``release`` the grant.

A gate guards one unit of one stage replica's capacity — media pixels, encode patches, prefill tokens
(:class:`common.admission.budget.BudgetGate`) or decode KV blocks (:class:`common.admission.kv.KVGate`). Lifecycle of
one request at a gate::

    acquire(amount, deadline, rank, tenant, weight, key=…, refuse=…, batch=…) ──► Grant ──(the work)──► release(grant)
        │ fits now (nobody waits) → granted at once (``waited_s`` 0)
        │ otherwise → waits its turn until it fits → granted (``waited_s`` > 0)
        └ refused instead: 429 Overloaded (the wait would outlast its deadline, or the queue is full — only when
          ``refuse``), 504 DeadlineExceeded (its deadline passed while it waited), 4xx (over a per-request limit)

``deadline`` is on the gate's clock (this process's monotonic seconds); ``rank`` orders a tenant's waiters
(:func:`common.admission.budget.rank`: arrival + size ÷ aging + a class delay); ``tenant`` and ``weight`` name whose
request it is and its share — the budget gates and the KV gate's lease queue serve tenants fairly by weight
(:mod:`common.fair`); ``batch`` is its class (interactive goes first); ``key`` files the grant
(decode: the attempt's key, which its ``generate`` later claims); ``refuse=False`` waits whatever the queue (a decode
migration: refusing it would end a stream the client is reading). Every decision is counted by
:class:`common.admission.record.AdmissionRecorder`, through :class:`common.admission.stage.StageAdmission` in the
stages and directly at the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Grant:
    amount: int
    """What was admitted (the request's amount, clamped to the budget); released as a whole."""
    waited_s: float
    """Time it waited in the gate's queue (0: granted at once)."""
    key: str = ""
    """What the gate filed it under (the caller's key, when it gave one)."""


class Gate(Protocol):
    stage: str
    """The stage it guards (``media``, ``encode``, ``prefill``, ``decode``): named in its refusals and metrics."""
    unit: str
    """What its amounts count (pixels, patches, tokens, KV blocks)."""

    async def acquire(
        self,
        amount: int,
        deadline: float,
        rank: float,
        tenant: str = "",
        weight: float = 1.0,
        *,
        key: str = "",
        refuse: bool = True,
        batch: bool = False,
    ) -> Grant:
        """Admit ``amount`` before ``deadline`` or raise (see the module docstring)."""
        ...

    def release(self, grant: Grant) -> None:
        """Give ``grant`` back, whatever became of the work (it may let waiters in)."""
        ...
