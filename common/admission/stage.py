"""A stage replica's admission: its gate (any :class:`common.admission.protocol.Gate`), the rank of each request, and
every decision recorded.

The media, encode and prefill stages each hold one over a :class:`common.admission.budget.BudgetGate` (pixels,
patches, prompt tokens); the decode stage holds one over its :class:`common.admission.kv.KVGate` (KV blocks). A
request is ranked by when the ingress sent it, its size (shortest first, with aging; 0 for the stages that keep
arrival order) and its class (batch behind interactive): :func:`common.admission.budget.rank`; it waits in its
tenant's queue, the tenants served by their configured ``weight`` (:mod:`common.fair`).
:meth:`StageAdmission.held` admits it for the duration of a block, and :meth:`StageAdmission.in_thread` for work run in
a worker thread — the grant is given back when the *thread* ends, not when an impatient caller stops waiting for it,
and the thread is told to stop (its :class:`Stop`) when the caller goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import TypeVar

from common.admission.budget import BudgetGate, rank
from common.admission.protocol import Gate, Grant
from common.admission.record import AdmissionRecorder, MetricSink
from common.config import AdmissionConfig
from common.errors import PrismError
from common.protocol.handoff import RequestContext
from common.stop import Stop

T = TypeVar("T")


class StageAdmission:
    def __init__(self, gate: Gate, cfg: AdmissionConfig, recorder: AdmissionRecorder) -> None:
        self.gate, self.cfg, self.recorder = gate, cfg, recorder

    async def admit(self, ctx: RequestContext, amount: int, size: float, key: str = "", refuse: bool = True) -> Grant:
        """Admit ``amount`` units for ``ctx``; ``size`` (in prompt tokens or patches) sets its rank; ``key`` files the
        grant (default: the attempt's key); ``refuse=False``: wait whatever the queue."""
        order = rank(ctx.sent_at, int(size), self.cfg.aging_tokens_per_s, ctx.batch, self.cfg.batch_delay_s)
        try:
            weight = self.cfg.quota(ctx.tenant).weight
            grant = await self.gate.acquire(
                amount,
                ctx.monotonic_deadline(),
                order,
                ctx.tenant,
                weight,
                key=key or ctx.key,
                refuse=refuse,
                batch=ctx.batch,
            )
        except PrismError as exc:
            self.recorder.refused_by(ctx.tenant, ctx.priority, exc)
            raise
        self.recorder.admitted(ctx.tenant, ctx.priority, grant.waited_s, grant.amount, self.gate.unit)
        return grant

    def release(self, grant: Grant) -> None:
        self.gate.release(grant)

    @asynccontextmanager
    async def held(self, ctx: RequestContext, amount: int, size: float) -> AsyncIterator[Grant]:
        grant = await self.admit(ctx, amount, size)
        try:
            yield grant
        finally:
            self.gate.release(grant)

    async def in_thread(self, grant: Grant, stop: Stop, fn: Callable[[], T], executor: Executor | None = None) -> T:
        """Run ``fn`` in a worker thread (of ``executor``; the loop's default pool when ``None``) under ``grant``:
        released when the thread ends; if the caller is cancelled first, ``stop`` is set so the thread ends at its next
        check."""
        task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(executor, fn))
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self.gate.release(grant)
            else:
                stop.cancel()
                task.add_done_callback(lambda t: (self.gate.release(grant), t.cancelled() or t.exception()))


def budget_admission(
    stage: str, unit: str, capacity: int, cfg: AdmissionConfig, sink: MetricSink | None
) -> StageAdmission:
    """A stage's admission over a :class:`BudgetGate` of ``capacity`` ``unit`` (media, encode, prefill)."""
    gate = BudgetGate(stage, unit, capacity, cfg.max_waiting, cfg.retry_after_s)
    return StageAdmission(gate, cfg, AdmissionRecorder(sink, stage))
