"""OS threads and priorities of a stage replica: torch's thread count, and the niceness that keeps throughput work
(media decoding, the vision tower; long prefills where so configured) off the cores the latency path needs.

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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from common.grammar.compiler import compiler_for
from common.grammar.guide import Guide

T = TypeVar("T")


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)


IDLE_FROM = 18
"""From this niceness on, a thread also runs under Linux's ``SCHED_IDLE`` policy (media decoding at 19; the vision
tower and grammar compiles at 18; long prefills only where ``long_lane_nice`` is set that high): the scheduler then
preempts it at once whenever a thread of the latency path wakes up, where a nice-19 thread may keep the core for the
rest of its time slice (a few ms, paid at every one of a request's many wake-ups across its hops). Measured with
``python -m loadtest.tenants`` (make serve's app, 48 clients of 1920×1440 JPEGs, no quota): the other tenant's text
TTFT p95 under the flood 101–156 ms over four runs at nice 18–19 alone, 81–89 ms over three with ``SCHED_IDLE``
(30–33 ms idle); the flood alone answered 17.8 vs 18.5 requests/s (96 %). Like a raised niceness it needs no
privilege, and is never undone. The price: such a thread also waits on its run queue while a Ray or Serve thread that
woke on its core runs, even when the other core is idle — a long prefill lane at 18 spent 6.4 s of a 21 s mixed load
waiting so (10 s on the CPU; the monolith's lane, with far fewer threads beside it, 2.2 s), which is why that lane
now stays at the replica's own priority by default."""


def nice_thread(nice: int, tid: int | None = None) -> None:
    """Raise the calling thread's (or thread ``tid``'s) niceness to ``nice`` (never lowers it: that needs privileges),
    and from :data:`IDLE_FROM` on put it under ``SCHED_IDLE``. On Linux both belong to each thread, and a new thread
    inherits its creator's — so a stage renices its process once at start (:func:`nice_process`) and its worker
    threads again when they run its work."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id() if tid is None else tid
    _renice(nice, tid)
    try:
        if nice >= IDLE_FROM and hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) != os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # the thread ended meanwhile, or the platform refuses: priority is an optimisation only
        pass


def nice_process(nice: int) -> None:
    """Raise the niceness of every thread of this process (see :func:`nice_thread`) — niceness only: its event loop
    and Ray's own threads keep the normal policy (answering calls and health checks is not throughput work); the
    threads that run the stage's work go to ``SCHED_IDLE`` when they take it up (:func:`nice_thread`)."""
    if nice <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    for tid in tids:
        _renice(nice, tid)


def _renice(nice: int, tid: int) -> None:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # the thread ended meanwhile, or the platform refuses: priority is an optimisation only
        pass


GRAMMAR_NICE = 18
"""Niceness of the thread that compiles output constraints: compiling is throughput work (tens of ms for a large
schema, in native code with the GIL released), never to be paid for by another tenant's short request."""
_grammar_pool: ThreadPoolExecutor | None = None
_grammar_pool_lock = threading.Lock()


def grammar_executor() -> ThreadPoolExecutor:
    """This process's one thread for grammar compiles, at :data:`GRAMMAR_NICE` (made on first use)."""
    global _grammar_pool
    with _grammar_pool_lock:
        if _grammar_pool is None:
            _grammar_pool = ThreadPoolExecutor(1, "prism-grammar", initializer=nice_thread, initargs=(GRAMMAR_NICE,))
        return _grammar_pool


async def compile_guide(model: Any, guide: Guide | None) -> None:
    """Check (compile) ``guide`` for ``model``'s tokenizer — at once when its grammar is cached, else on the grammar
    thread — raising its 400 if it cannot be served. Neither the event loop nor the default worker threads (which
    parse bodies and open hand-offs for every request) ever run a compile."""
    if guide is None:
        return
    compiler = compiler_for(model)
    if compiler.cached(guide):
        return
    await asyncio.get_running_loop().run_in_executor(grammar_executor(), compiler.check, guide)


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
