"""One admission protocol and one recorder: every stage budget and the decode KV reservation are gates with the same
``acquire`` / ``release``, and every admission decision — ingress, stage budgets, decode KV — is counted by
:class:`common.admission.record.AdmissionRecorder` and nothing else."""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from dataclasses import replace

import pytest

from common.admission.budget import BudgetGate
from common.admission.kv import KVGate
from common.admission.protocol import Gate
from common.admission.record import ADMISSION_TOTAL, ADMISSION_UNITS, ADMISSION_WAIT, AdmissionRecorder
from common.admission.stage import StageAdmission, budget_admission
from common.config import AdmissionConfig
from common.errors import DeadlineExceeded, InvalidRequestError, Overloaded
from common.protocol.handoff import RequestContext
from tests.paths import ROOT


class Sink:
    """Stands in for a replica's metrics: what was counted and observed, by name and tags."""

    def __init__(self) -> None:
        self.counts: list[dict[str, str]] = []
        self.waits: list[tuple[float, dict[str, str]]] = []
        self.units: list[tuple[float, dict[str, str]]] = []

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        assert name in (ADMISSION_TOTAL, ADMISSION_UNITS)
        if name == ADMISSION_UNITS:
            self.units.append((value, tags))
        else:
            self.counts.append(tags)

    def observe(self, name: str, value: float, **tags: str) -> None:
        assert name == ADMISSION_WAIT
        self.waits.append((value, tags))

    def outcomes(self) -> list[tuple[str, str, str]]:
        return [(c["stage"], c["result"], c["reason"]) for c in self.counts]


def _ctx(rid: str, left_s: float, tenant: str = "t", priority: str = "interactive") -> RequestContext:
    now = time.time()
    return RequestContext(rid, tenant, now + left_s, now, priority=priority)  # type: ignore[arg-type]


def test_both_gates_speak_the_protocol():
    """Same methods, same parameters, in the same order: a stage's admission takes either."""
    wanted = inspect.signature(Gate.acquire).parameters
    for gate in (BudgetGate, KVGate):
        got = inspect.signature(gate.acquire).parameters
        assert list(got) == list(wanted), gate
        assert [p.kind for p in got.values()] == [p.kind for p in wanted.values()], gate
        assert list(inspect.signature(gate.release).parameters) == ["self", "grant"], gate


def test_a_stage_budget_records_every_decision():
    sink = Sink()
    adm = budget_admission("encode", "patches", 100, AdmissionConfig(max_waiting=1, retry_after_s=1.0), sink)

    async def scenario() -> None:
        first = await adm.admit(_ctx("a", 30, "alpha"), 100, 100)  # immediate
        waiter = asyncio.ensure_future(adm.admit(_ctx("b", 30, "beta", "batch"), 50, 50))  # waits
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):  # the queue (max_waiting=1) is full, with beta's own request
            await adm.admit(_ctx("c", 30, "beta"), 10, 10)
        with pytest.raises(DeadlineExceeded):
            await adm.admit(_ctx("d", -1), 10, 10)
        adm.release(first)
        adm.release(await asyncio.wait_for(waiter, 5))

    asyncio.run(scenario())
    assert sink.outcomes() == [
        ("encode", "admitted", "immediate"),
        ("encode", "refused", "budget_full"),
        ("encode", "refused", "deadline"),
        ("encode", "admitted", "waited"),
    ]
    assert [c["tenant"] for c in sink.counts] == ["alpha", "beta", "t", "beta"]
    assert [c["class"] for c in sink.counts] == ["interactive", "interactive", "interactive", "batch"]
    assert len(sink.waits) == 2 and sink.waits[0][0] == 0 and sink.waits[1][0] > 0
    assert [w[1]["tenant"] for w in sink.waits] == ["alpha", "beta"]
    # each tenant's share of the stage's service, in its unit
    assert sink.units == [
        (100.0, {"stage": "encode", "tenant": "alpha", "unit": "patches"}),
        (50.0, {"stage": "encode", "tenant": "beta", "unit": "patches"}),
    ]
    assert adm.gate.used == 0


def test_a_budget_gate_that_must_not_refuse_waits_instead():
    """``refuse=False`` (what a decode migration asks of its KV gate) waits behind a full queue rather than a 429."""
    gate = BudgetGate("prefill", "tokens", 10, max_waiting=0, retry_after_s=1.0)

    async def scenario() -> None:
        held = await gate.acquire(10, time.monotonic() + 30, 0.0)
        with pytest.raises(Overloaded):
            await gate.acquire(5, time.monotonic() + 30, 1.0)
        waiting = asyncio.ensure_future(gate.acquire(5, time.monotonic() + 30, 1.0, refuse=False))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        gate.release(held)
        gate.release(await asyncio.wait_for(waiting, 5))
        assert gate.used == 0

    asyncio.run(scenario())


@pytest.fixture
def decode(model_cache):
    from services.stages.decode import DecodeDeployment

    config = {
        "model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1},
        "engine": {"kv_pool_blocks": 16, "max_lease_fraction": 0.5},
        "deployments": {"decode": {"max_ongoing_requests": 4}},
    }
    d = DecodeDeployment(config)
    d.admission.recorder.sink = sink = Sink()
    return d, sink


def test_the_decode_kv_gate_records_through_the_same_recorder(decode):
    d, sink = decode
    assert isinstance(d.admission, StageAdmission) and isinstance(d.admission.gate, KVGate)

    async def scenario() -> None:
        await d.reserve(_ctx("a", 30), 8)  # granted at once
        await d.reserve(_ctx("b", 30), 8)  # the pool is fully reserved now
        with pytest.raises(Overloaded):  # would wait past its deadline
            await d.reserve(_ctx("c", 0.5), 4)
        waiting = asyncio.ensure_future(d.reserve(_ctx("w", 30), 4))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):  # no request slot left for its generate
            await d.reserve(_ctx("s", 30), 1)
        assert await d.unreserve(_ctx("a", 30))
        await asyncio.wait_for(waiting, 5)
        with pytest.raises(InvalidRequestError):  # over the per-request lease (a migration's: no wait rule first)
            await d.reserve(replace(_ctx("big", 30), replay=(1,)), 99)
        for rid in ("b", "w"):
            assert await d.unreserve(_ctx(rid, 30))

    asyncio.run(scenario())
    assert sink.outcomes() == [
        ("decode", "admitted", "immediate"),
        ("decode", "admitted", "immediate"),
        ("decode", "refused", "budget_full"),
        ("decode", "refused", "budget_full"),
        ("decode", "admitted", "waited"),
        ("decode", "refused", "limit"),
    ]
    assert d.engine.num_reserved == 0 and d.pool.available_blocks == 16


def test_an_unclaimed_reservation_lapses_after_the_hold_not_at_its_deadline(decode):
    """A reservation whose sequence never comes (its ingress went away between reserve and prefill) gives its blocks
    back ``admission.reservation_hold_s`` after the grant, not at the request's (much later) deadline."""
    d, _ = decode
    d.kv.hold_s, d.kv.sweep_s = 0.3, 0.05

    async def scenario() -> tuple[int, int, int]:
        await d.reserve(_ctx("gone", 600), 8)
        held = d.pool.available_blocks
        await asyncio.sleep(0.1)
        still = d.engine.num_reserved
        deadline = time.monotonic() + 5
        while d.engine.num_reserved and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return held, still, d.pool.available_blocks

    held, still, after = asyncio.run(scenario())
    assert (held, still) == (8, 1)  # held while the hold runs
    assert d.engine.num_reserved == 0 and after == 16  # then lapsed, 600 s before its deadline


def test_no_module_counts_an_admission_decision_but_the_recorder():
    """The metric's name is written in the catalogue (its declaration), the dashboards (queries) and the recorder;
    any other module that names it would be counting decisions on its own."""
    named = set()
    for top in ("common", "services", "loadtest"):
        for path in (ROOT / top).rglob("*.py"):
            if re.search(r"prism_admission_(total|wait_seconds)", path.read_text(encoding="utf-8")):
                named.add(path.relative_to(ROOT).as_posix())
    assert named == {"common/admission/record.py", "common/obs/catalogue.py", "common/obs/dashboards.py"}, named


def test_a_recorder_without_a_sink_records_nothing():
    AdmissionRecorder(None, "ingress").admitted("t", "interactive", 1.0)  # (a component built without metrics)
