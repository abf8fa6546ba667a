"""Every admission decision, counted in one place: ``prism_admission_total{stage, tenant, class, result, reason}``,
the time an admitted request waited, ``prism_admission_wait_seconds{stage, class, tenant}``, and the units a stage's
gate granted each tenant, ``prism_admission_units_total{stage, tenant, unit}`` (its share of the stage's service).

One :class:`AdmissionRecorder` per gate-holding component: the ingress (its per-request limits and tenant quotas,
reasons ``limit`` / ``quota``) and each stage's :class:`common.admission.stage.StageAdmission` (its budget or KV gate:
``budget_full``, ``deadline``, ``limit``). An admitted request's reason is ``immediate`` or ``waited``. The recorder
writes through any sink with ``inc`` and ``observe`` (:class:`services.platform.metrics.Metrics` in a replica; a
recording fake in tests), so this module stays Ray-free.
"""

from __future__ import annotations

from typing import Protocol

from common.errors import DeadlineExceeded, Overloaded, PrismError

ADMISSION_TOTAL = "prism_admission_total"
ADMISSION_WAIT = "prism_admission_wait_seconds"
ADMISSION_UNITS = "prism_admission_units_total"


class MetricSink(Protocol):
    def inc(self, name: str, value: float = 1.0, **tags: str) -> None: ...

    def observe(self, name: str, value: float, **tags: str) -> None: ...


def refusal_reason(exc: PrismError) -> str:
    """The ``reason`` label of a gate's refusal."""
    if isinstance(exc, Overloaded):
        return "budget_full"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    return "limit"


class AdmissionRecorder:
    def __init__(self, sink: MetricSink | None, stage: str) -> None:
        """``sink``: where the counts go (``None``: nowhere — a component built without metrics)."""
        self.sink, self.stage = sink, stage

    def admitted(self, tenant: str, cls: str, waited_s: float | None = None, units: int = 0, unit: str = "") -> None:
        """An admission; ``waited_s`` (a gate's wait, observed too) — ``None`` where nothing can wait (the ingress);
        ``units`` of ``unit`` granted (a gate's grant)."""
        self._count(tenant, cls, "admitted", "waited" if waited_s else "immediate")
        if self.sink is None:
            return
        if waited_s is not None:
            self.sink.observe(ADMISSION_WAIT, waited_s, stage=self.stage, tenant=tenant, **{"class": cls})
        if units > 0:
            self.sink.inc(ADMISSION_UNITS, float(units), stage=self.stage, tenant=tenant, unit=unit)

    def refused(self, tenant: str, cls: str, reason: str) -> None:
        self._count(tenant, cls, "refused", reason)

    def refused_by(self, tenant: str, cls: str, exc: PrismError) -> None:
        """A gate's refusal, its reason read from the error it raised."""
        self.refused(tenant, cls, refusal_reason(exc))

    def _count(self, tenant: str, cls: str, result: str, reason: str) -> None:
        if self.sink is not None:
            tags = {"stage": self.stage, "tenant": tenant, "class": cls, "result": result, "reason": reason}
            self.sink.inc(ADMISSION_TOTAL, **tags)
