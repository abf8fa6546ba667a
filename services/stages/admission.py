"""A stage replica's admission: its :class:`BudgetGate` (:mod:`common.admission.budget`) plus the metrics of each
decision.

The media, encode and prefill deployments each hold one, over their own unit (pixels, patches, prompt tokens). A
request is ranked by when the ingress sent it, its size (shortest first, with aging) and its class (batch behind
interactive); :meth:`StageAdmission.held` admits it for the duration of a block, and :meth:`StageAdmission.in_thread`
for work run in a worker thread — the budget is given back when the *thread* ends, not when an impatient caller
stops waiting for it, and the thread is told to stop (its :class:`Stop`) when the caller goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from common.admission.budget import BudgetGate, Grant, rank
from common.config import AdmissionConfig
from common.errors import DeadlineExceeded, Overloaded
from common.protocol.handoff import RequestContext
from common.stop import Stop
from services.platform.metrics import Metrics

T = TypeVar("T")


class StageAdmission:
    def __init__(self, stage: str, unit: str, capacity: int, cfg: AdmissionConfig, metrics: Metrics) -> None:
        self.cfg, self.metrics, self.stage = cfg, metrics, stage
        self.gate = BudgetGate(stage, unit, capacity, cfg.max_waiting, cfg.retry_after_s)

    def _count(self, ctx: RequestContext, result: str, reason: str) -> None:
        self.metrics.inc(
            "prism_admission_total", tenant=ctx.tenant, result=result, reason=reason, **{"class": ctx.priority}
        )

    async def admit(self, ctx: RequestContext, amount: int, size: float) -> Grant:
        """Admit ``amount`` units for ``ctx``; ``size`` (in prompt tokens or patches) sets its rank."""
        order = rank(ctx.sent_at, int(size), self.cfg.aging_tokens_per_s, ctx.batch, self.cfg.batch_delay_s)
        try:
            grant = await self.gate.acquire(amount, ctx.monotonic_deadline(), order)
        except Overloaded:
            self._count(ctx, "refused", "budget_full")
            raise
        except DeadlineExceeded:
            self._count(ctx, "refused", "deadline")
            raise
        self._count(ctx, "admitted", "waited" if grant.waited_s > 0 else "immediate")
        self.metrics.observe("prism_admission_wait_seconds", grant.waited_s, **{"class": ctx.priority})
        return grant

    @asynccontextmanager
    async def held(self, ctx: RequestContext, amount: int, size: float) -> AsyncIterator[Grant]:
        grant = await self.admit(ctx, amount, size)
        try:
            yield grant
        finally:
            self.gate.release(grant.amount)

    async def in_thread(self, grant: Grant, stop: Stop, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread under ``grant``: released when the thread ends; if the caller is cancelled
        first, ``stop`` is set so the thread ends at its next check."""
        task = asyncio.ensure_future(asyncio.to_thread(fn))
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self.gate.release(grant.amount)
            else:
                stop.cancel()
                task.add_done_callback(lambda t: (self.gate.release(grant.amount), t.cancelled() or t.exception()))
