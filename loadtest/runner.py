"""Runs a workload against an endpoint: open loop (requests sent at precomputed arrival times, whatever the server
does) or closed loop (N workers, each sending its next request when the previous one ends).

Requests of an open loop are built before the run's clock starts (:func:`plan`; image encoding must not eat into the
send schedule), and a caller running several loads at once builds every plan before starting any of them — building
one inside a running event loop would stall the other load's sends and timings, and its CPU would compete with the
server being measured. Progress goes to
``progress`` (stderr by default) once a second: elapsed, sent, finished, ok, non-200, in flight.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from loadtest.arrivals import Process, arrival_times
from loadtest.client import send
from loadtest.stats import RequestRecord
from loadtest.workload import Workload


@dataclass
class RunSpec:
    url: str
    """Base URL of the OpenAI-compatible API (``…/v1``)."""
    model: str
    duration_s: float = 30.0
    rate: float | None = 2.0
    """Requests/s for an open loop; ``None`` with ``concurrency`` for a closed loop."""
    process: Process = "poisson"
    cv: float = 1.0
    concurrency: int | None = None
    api_key: str | None = None
    trace: bool = True
    timeout_s: float = 120.0
    seed: int = 0


def plan(spec: RunSpec, workload: Workload) -> list[tuple[float, str, dict[str, Any]]]:
    """An open loop's requests: (send time, kind, body), bodies fully built."""
    if spec.rate is None:
        raise ValueError("an open loop needs a rate")
    times = arrival_times(spec.process, spec.rate, spec.duration_s, spec.seed, spec.cv)
    return [(t, *req) for t, req in zip(times, workload.next_requests(spec.model, len(times)), strict=True)]


async def run(
    spec: RunSpec,
    workload: Workload,
    progress: TextIO | None = sys.stderr,
    planned: list[tuple[float, str, dict[str, Any]]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """(records, measured duration). An open loop sends ``planned`` (default: :func:`plan`, built before the clock
    starts)."""
    if not spec.concurrency and planned is None:
        planned = plan(spec, workload)
    endpoint = spec.url.rstrip("/") + "/chat/completions"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=spec.timeout_s) as http:
        start = time.perf_counter()
        state = {"sent": 0}

        async def one(kind: str, body: dict[str, Any]) -> None:
            state["sent"] += 1
            sent_at = time.perf_counter() - start
            records.append(await send(http, endpoint, body, kind, sent_at, spec.api_key, spec.trace, spec.timeout_s))

        reporter = asyncio.create_task(_report(progress, start, state, records)) if progress else None
        try:
            if spec.concurrency:
                await _closed(spec, workload, one, start)
            else:
                await _open(planned or [], one, start)
        finally:
            if reporter:
                reporter.cancel()
        duration = time.perf_counter() - start
    if progress:
        _line(progress, start, state, records, final=True)
    return records, duration


async def _open(planned: list[tuple[float, str, dict[str, Any]]], one: Callable, start: float) -> None:
    tasks = []
    for t, kind, body in planned:
        delay = t - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(kind, body)))
    await asyncio.gather(*tasks)


async def _closed(spec: RunSpec, workload: Workload, one: Callable, start: float) -> None:
    async def worker() -> None:
        while time.perf_counter() - start < spec.duration_s:
            await one(*workload.next_request(spec.model))

    await asyncio.gather(*(worker() for _ in range(spec.concurrency or 1)))


async def _report(out: TextIO, start: float, state: dict, records: list[RequestRecord]) -> None:
    while True:
        await asyncio.sleep(1.0)
        _line(out, start, state, records)


def _line(out: TextIO, start: float, state: dict, records: list[RequestRecord], final: bool = False) -> None:
    ok = sum(r.ok for r in records)
    bad = len(records) - ok
    inflight = state["sent"] - len(records)
    end = "\n" if final or not out.isatty() else "\r"
    out.write(
        f"[loadtest] t={time.perf_counter() - start:6.1f}s sent={state['sent']} done={len(records)} ok={ok} "
        f"failed={bad} in_flight={inflight}{end}"
    )
    out.flush()
