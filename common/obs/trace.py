"""Per-request traces: contiguous stage spans that decompose a request's time to first token.

Lifecycle: the ingress starts a :class:`Timeline` when a request arrives and stamps ``sent_at`` on every stage call.
Each stage opens its own timeline at the moment its upstream finished (``Traced.end`` of the value it received, or
``sent_at`` for the first stage), so its first span — ``<stage>.transfer`` or ``<stage>.queue`` — is the hand-off and
routing time, then it marks its work spans, and returns its result wrapped in :class:`Traced` with every span so far.
The spans ride along with the data (media → encode → prefill → decode → ingress), never through a side channel, so
the ingress ends up with one ordered chain whose durations add up to the time to first token.

Clocks: spans use wall-clock seconds (``time.time``) because they cross processes; on one node that clock is shared,
across nodes it is as good as NTP. Attributes hold shapes, counts, cache outcomes and keyed hashes — never URLs,
prompt text or pixels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
AttrValue = int | float | str | bool | list[str]


@dataclass(frozen=True)
class Span:
    name: str
    start: float
    """Wall-clock seconds."""
    duration_s: float
    attrs: dict[str, AttrValue] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.duration_s


@dataclass(frozen=True)
class Traced(Generic[T]):
    """A stage's result with the request's spans so far; ``end`` is when the stage handed it on."""

    value: T
    spans: tuple[Span, ...]
    end: float


class Timeline:
    """Builds contiguous spans: each one starts where the previous ended."""

    def __init__(self, start: float, spans: Iterable[Span] = (), clock: Callable[[], float] = time.time) -> None:
        self.spans: list[Span] = list(spans)
        self.last = start
        self.clock = clock

    @classmethod
    def after(cls, upstream: object, sent_at: float, clock: Callable[[], float] = time.time) -> Timeline:
        """The timeline of a stage that received ``upstream`` (a :class:`Traced`, or a plain value when it is the
        first stage): it continues the upstream's spans from the moment the upstream finished."""
        if isinstance(upstream, Traced):
            return cls(upstream.end, upstream.spans, clock)
        return cls(sent_at, (), clock)

    def mark(self, name: str, **attrs: AttrValue) -> Span:
        """Close a span from the previous mark to now."""
        return self.span(name, max(0.0, self.clock() - self.last), **attrs)

    def mark_until(self, name: str, instant: float | None, **attrs: AttrValue) -> Span:
        """Close a span at ``instant``, a reading of ``time.monotonic()`` in this process (an engine's clock) — placed
        on this wall-clock timeline by how long ago it was. ``None`` (the event never happened): a span ending now."""
        if instant is None:
            return self.mark(name, **attrs)
        return self.span(name, (self.clock() - self.last) - (time.monotonic() - instant), **attrs)

    def span(self, name: str, duration_s: float, **attrs: AttrValue) -> Span:
        """Append a span of a known duration (measured on any clock) starting at the previous mark."""
        span = Span(name, self.last, max(0.0, duration_s), dict(attrs))
        self.spans.append(span)
        self.last = span.end
        return span

    def wrap(self, value: T) -> Traced[T]:
        return Traced(value, tuple(self.spans), self.last)


def waited(name: str, since: float, **attrs: AttrValue) -> Traced[list]:
    """An empty hand-off whose spans show one wait, from ``since`` to now: a text-only request's KV reservation, so
    prefill's timeline starts after it."""
    now = time.time()
    return Traced([], (Span(name, since, max(0.0, now - since), attrs),), now)


def unwrap(value: Traced[T] | T) -> T:
    return value.value if isinstance(value, Traced) else value


def durations(spans: Iterable[Span], prefix: str) -> float:
    """Seconds spent in spans named ``prefix`` or ``prefix.*``."""
    return sum(s.duration_s for s in spans if s.name == prefix or s.name.startswith(prefix + "."))
