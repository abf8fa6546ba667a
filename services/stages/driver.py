"""The engine driver loop every stage deployment runs its engine with.

An engine (encode, prefill, decode) is single-threaded state. Its deployment owns one :class:`EngineDriver`: request
coroutines submit/cancel under an ``asyncio.Lock`` and wait on their own futures/queues; one background task runs
``engine.step()`` in a worker thread (so the replica's event loop keeps accepting requests) whenever there is work,
and hands results to the waiting coroutines. :class:`AwaitedEngine` is that pattern for one result per request
(encode, prefill); decode streams tokens through per-request queues instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from common.errors import DeadlineExceeded, PrismError

log = logging.getLogger("prism.stage")


class EngineDriver:
    """Runs ``step()`` in a thread whenever ``has_work()``; ``deliver(result)`` routes each step's output.

    If a step raises, ``fail(exc)`` must drop everything the engine holds and fail its waiters — otherwise the same
    poisoned work would fail every step and its callers would wait until their deadlines.
    """

    def __init__(
        self,
        step: Callable[[], Any],
        has_work: Callable[[], bool],
        deliver: Callable[[Any], None],
        fail: Callable[[BaseException], None] | None = None,
        executor: Any = None,
    ) -> None:
        """``executor``: where steps run (default: the loop's shared pool); a dedicated one keeps a step thread's OS
        priority (:func:`nice_thread`) from leaking to other work of the replica."""
        self.lock = asyncio.Lock()
        self._executor = executor
        self._step, self._has_work, self._deliver, self._fail = step, has_work, deliver, fail
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failures = 0
        """Steps failed in a row (0 after any step that worked): what the stage's health check reads."""

    def poke(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.lock:
                try:
                    result = await asyncio.get_running_loop().run_in_executor(self._executor, self._step)
                except Exception as exc:
                    log.exception("engine step failed")
                    self.failures += 1
                    if self._fail is None:
                        raise
                    self._fail(exc)
                    continue
            self.failures = 0
            self._deliver(result)
            await asyncio.sleep(0)  # let waiting submits take the lock between steps


UNHEALTHY_AFTER = 3
"""Steps failed in a row after which a stage reports unhealthy to Serve (which then replaces the replica): one failed
step can be one poisoned request; three in a row, with the queue dropped after each, is the engine itself."""


def check_engines(stage: str, failures: list[int]) -> None:
    """A stage's ``check_health`` (Serve calls it every ``health_check_period_s``): raise — the replica is unhealthy
    and Serve replaces it — once one of its engines has failed :data:`UNHEALTHY_AFTER` steps in a row."""
    worst = max(failures, default=0)
    if worst >= UNHEALTHY_AFTER:
        raise RuntimeError(f"the {stage} engine failed its last {worst} steps")


class AwaitedEngine:
    """An engine whose callers each wait for one result per request id (the encode and prefill stages).

    :meth:`run` submits under the engine lock and awaits the request's future; each step's output is routed to the
    futures by ``results(output) → (request_id, value) pairs``. With ``expire``, each step first drops the requests
    whose deadline passed in the engine's queue (``expire() → their ids``) and fails their callers with a 504. A
    caller that goes away (cancelled) has its request dropped from the engine; a failing step drops every queued
    request and fails its caller with a 500.
    """

    def __init__(
        self,
        step: Callable[[], Any],
        has_work: Callable[[], bool],
        results: Callable[[Any], Iterable[tuple[str, Any]]],
        cancel: Callable[[str], object],
        expire: Callable[[], list[str]] | None = None,
        stage: str = "engine",
        executor: Any = None,
        orphaned: Callable[[Any], None] | None = None,
    ) -> None:
        """``orphaned(value)``: a result whose caller went away before it was delivered (what it holds goes back)."""
        self._results, self._cancel, self._stage = results, cancel, stage
        self._orphaned = orphaned
        self.waiting: dict[str, asyncio.Future] = {}

        def expire_then_step() -> tuple[list[str], Any]:
            return (expire() if expire is not None else []), step()

        self.driver = EngineDriver(expire_then_step, has_work, self._deliver, self._fail, executor)

    async def run(self, request_id: str, submit: Callable[[], Any]) -> Any:
        """``submit()`` queues the request (under the lock); a non-``None`` return is the result, at once."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        queued = False
        try:
            async with self.driver.lock:
                immediate = submit()
            if immediate is not None:
                return immediate
            queued = True
            self.driver.poke()
            return await future
        finally:
            self.waiting.pop(request_id, None)
            # A caller cancelled while waiting also cancels the future itself, so "done" alone does not mean the
            # engine finished with this request: only a result or an exception does.
            if queued and (future.cancelled() or not future.done()):
                async with self.driver.lock:
                    self._cancel(request_id)

    def _deliver(self, output: tuple[list[str], Any]) -> None:
        expired, done = output
        for rid in expired:
            future = self.waiting.get(rid)
            if future is not None and not future.done():
                future.set_exception(DeadlineExceeded(f"deadline exceeded while queued in the {self._stage} stage"))
        for rid, value in self._results(done):
            future = self.waiting.get(rid)
            if future is not None and not future.done():
                future.set_result(value)
            elif self._orphaned is not None:
                self._orphaned(value)

    def _fail(self, exc: BaseException) -> None:
        for rid, future in list(self.waiting.items()):
            self._cancel(rid)
            if not future.done():
                future.set_exception(PrismError(f"{type(exc).__name__} in the engine; the request was dropped"))
