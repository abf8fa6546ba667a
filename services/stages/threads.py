"""OS threads and priorities of a stage replica: torch's thread count, and the niceness that keeps throughput work
(media decoding, the vision tower, long prefills) off the cores the latency path needs.

On Linux niceness belongs to each thread, and a new thread inherits its creator's: a stage renices its process once at
start (:func:`nice_process`) and its worker threads again when they run its work (:func:`nice_thread`). Niceness is
only ever raised here — lowering it needs privileges. Prism's clusters start Ray's workers at 0, not Ray's default
15, so that a raised niceness is a real difference (:mod:`services.platform.priority`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


def nice_thread(nice: int, tid: int | None = None) -> None:
    """Raise the calling thread's (or thread ``tid``'s) niceness to ``nice`` (never lowers it: that needs privileges).
    On Linux niceness belongs to each thread, and a new thread inherits its creator's — so a stage renices its
    process once at start (:func:`nice_process`) and its worker threads again when they run its work."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id() if tid is None else tid
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # the thread ended meanwhile, or the platform refuses: priority is an optimisation only
        pass


def nice_process(nice: int) -> None:
    """Raise the niceness of every thread of this process (see :func:`nice_thread`)."""
    if nice <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    for tid in tids:
        nice_thread(nice, tid)


async def finish_in_thread(fn: Callable[[], T], abandoned: Callable[[T], object] | None = None) -> T:
    """``fn()`` in a worker thread, awaited to its end even when the caller is cancelled first: a hand-off's bytes
    must stop arriving before the memory they land in is given back. A cancelled caller's result goes to
    ``abandoned`` (what it holds is freed there), then the cancellation goes on."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        done = (await asyncio.gather(task, return_exceptions=True))[0]
        if abandoned is not None and not isinstance(done, BaseException):
            abandoned(done)
        raise
