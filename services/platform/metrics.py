"""Prism's Prometheus metrics, recorded through Ray (exported on the Ray metrics port, ``ray_`` prefixed).

One :class:`Metrics` per process per stage, built from the declarations in :mod:`common.obs.catalogue` (the single
source of names, tags and buckets). Created inside a Serve replica, every series also gets ``application``,
``deployment`` and ``replica`` labels from Serve; the ``stage`` tag is filled in here. Recording is cheap (Ray
aggregates in-process and exports every few seconds), so stages record per request.

Gauges are also re-set every ``REFRESH_S`` by a daemon thread (:meth:`Metrics.keep_fresh`): a value set only once —
``prism_replicas`` at start-up, an idle stage's zero queue — can be set before the worker's exporter is connected,
and a gauge that is never set again would then never appear.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

from common.grammar.compiler import CompileStats, process_stats
from common.obs.catalogue import BY_NAME, MetricSpec


def _make(spec: MetricSpec) -> Any:
    if spec.kind == "counter":
        return Counter(spec.name, description=spec.description, tag_keys=spec.tags)
    if spec.kind == "gauge":
        return Gauge(spec.name, description=spec.description, tag_keys=spec.tags)
    return Histogram(spec.name, description=spec.description, boundaries=list(spec.buckets), tag_keys=spec.tags)


REFRESH_S = 2.0

_MADE: dict[str, Any] = {}
_GRAMMAR_SEEN: dict[str, CompileStats] = {}
"""The process's compile counters as last reported (:meth:`Metrics.grammar`)."""
_GRAMMAR_LOCK = threading.Lock()
"""The Ray metric objects this process made, by name: the stages of a grouped deployment (one process) each have a
:class:`Metrics`, and share these (Ray keeps one series per name and tag set in a process)."""


class Metrics:
    def __init__(self, stage: str) -> None:
        self.stage = stage
        self._objs: dict[str, Any] = {}
        self._grammar_seen: tuple[float, int] = (0.0, 0)

    def _obj(self, name: str) -> Any:
        """The Ray metric, made on first use (so a process only registers what it records)."""
        obj = self._objs.get(name)
        if obj is None:
            obj = self._objs[name] = _MADE.get(name) or _MADE.setdefault(name, _make(BY_NAME[name]))
        return obj

    def _tags(self, name: str, tags: dict[str, str]) -> dict[str, str]:
        if "stage" in BY_NAME[name].tags:
            tags.setdefault("stage", self.stage)
        return tags

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value > 0:
            self._obj(name).inc(value, tags=self._tags(name, tags))

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._obj(name).observe(value, tags=self._tags(name, tags))

    def set(self, name: str, value: float, **tags: str) -> None:
        self._obj(name).set(value, tags=self._tags(name, tags))

    # ---- the patterns every stage uses --------------------------------------------------------------------------
    def keep_fresh(self, refresh: Callable[[], None]) -> None:
        """Call ``refresh`` (which sets this replica's gauges) now and every ``REFRESH_S`` for the process's life."""

        def loop() -> None:
            while True:
                self.set("prism_replicas", 1)
                refresh()
                time.sleep(REFRESH_S)

        refresh()
        threading.Thread(target=loop, name=f"prism-metrics-{self.stage}", daemon=True).start()

    def load(self, in_flight: float, queue_depth: float) -> None:
        self.set("prism_stage_in_flight", in_flight)
        self.set("prism_stage_queue_depth", queue_depth)

    def stage_time(self, queue_s: float, work_s: float) -> None:
        self.observe("prism_stage_queue_seconds", queue_s)
        self.observe("prism_stage_work_seconds", work_s)

    def transfer(self, backend: str, payload: str, nbytes: int, seconds: float) -> None:
        self.inc("prism_transfer_bytes_total", nbytes, backend=backend, payload=payload)
        self.observe("prism_transfer_seconds", seconds, backend=backend, payload=payload)

    def cache_lookups(self, cache: str, hits: int, misses: int) -> None:
        self.inc("prism_cache_lookups_total", hits, cache=cache, result="hit")
        self.inc("prism_cache_lookups_total", misses, cache=cache, result="miss")

    def cache_bytes(self, cache: str, nbytes: int) -> None:
        self.set("prism_cache_bytes", nbytes, cache=cache)

    def grammar(self, mask_s: float | None = None, masked_steps: int = 0) -> None:
        """Count what this process's grammar compilers did since the last call (once per process: the stages of a
        group share its compilers) and, from a decode engine's running totals, its mask time."""
        with _GRAMMAR_LOCK:  # (the snapshot inside the lock: a group's stages each report from a thread of their own)
            stats = process_stats()
            last = _GRAMMAR_SEEN.get("compiles", CompileStats())
            _GRAMMAR_SEEN["compiles"] = stats
        self.inc("prism_grammar_compiles_total", stats.compiles - stats.refused - (last.compiles - last.refused),
                 result="compiled")  # fmt: skip
        self.inc("prism_grammar_compiles_total", stats.refused - last.refused, result="refused")
        self.inc("prism_grammar_compiles_total", stats.hits - last.hits, result="cached")
        self.inc("prism_grammar_compile_seconds_total", stats.compile_s - last.compile_s)
        if mask_s is not None:
            seen = self._grammar_seen
            self.inc("prism_grammar_mask_seconds_total", mask_s - seen[0])
            self.inc("prism_grammar_masked_steps_total", masked_steps - seen[1])
            self._grammar_seen = (mask_s, masked_steps)
