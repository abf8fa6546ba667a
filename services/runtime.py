"""Shared plumbing of the stage deployments: deadlines, thread settings, and the engine driver loop.

An engine (encode, prefill, decode) is single-threaded state. Its deployment owns one :class:`EngineDriver`: request
coroutines submit/cancel under an ``asyncio.Lock`` and wait on their own futures/queues; one background task runs
``engine.step()`` in a worker thread (so the replica's event loop keeps accepting requests) whenever there is work,
and hands results to the waiting coroutines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from common.errors import DeadlineExceeded

log = logging.getLogger("prism.stage")


def check_deadline(deadline: float, stage: str) -> float:
    """Seconds left before ``deadline`` (wall clock); raise 504 ``deadline_exceeded`` if none."""
    left = deadline - time.time()
    if left <= 0:
        raise DeadlineExceeded(f"deadline exceeded before the {stage} stage could start")
    return left


def monotonic_deadline(deadline: float) -> float:
    """A wall-clock deadline (comparable across processes) on this process's monotonic clock."""
    return time.monotonic() + (deadline - time.time())


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


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
    ) -> None:
        self.lock = asyncio.Lock()
        self._step, self._has_work, self._deliver, self._fail = step, has_work, deliver, fail
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

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
                    result = await asyncio.to_thread(self._step)
                except Exception as exc:
                    log.exception("engine step failed")
                    if self._fail is None:
                        raise
                    self._fail(exc)
                    continue
            self._deliver(result)
            await asyncio.sleep(0)  # let waiting submits take the lock between steps
