"""Cache affinity: which replica of a stage should get a piece of work so that its cache already holds it.

Lifecycle. The ingress makes a request's :class:`RouteKeys` once, from what it already has in hand (the media
references, the prompt's text tokens), and carries them in the :class:`~common.protocol.handoff.RequestContext` beside
the payload — a Serve request router sees the call's arguments after Serve resolved a chained response to an
``ObjectRef``, so it could not read a digest out of the media stage's output without pulling the pixels. Each stage's
router (:mod:`services.routers.affinity`) keeps one :class:`AffinityTable` and asks it for a replica per call; Serve
then sends the call there, or — the replica's queue being full — to the next replica the table ranked.

Keys:

* **media** — one per media item: a ``data:`` URL is keyed by its encoded bytes (identical bytes, identical key; a
  sample of them, see :func:`media_key`), a fetched URL by the URL itself. Both cost microseconds at the ingress and
  add no hop. A fetched URL's content is known only after the media stage fetched it; keying by the URL instead means
  that two URLs of the same bytes land on their own replicas (a cache miss, never a wrong answer: the encoder cache is
  keyed by the content digest) and that a URL whose signature changes per request (pre-signed object-store links) gets
  no affinity. The encode call is routed by the request's first media item.
* **prefix** — the prompt's start as prefill's prefix cache sees it: the tenant's cache scope, then the text tokens
  up to and including the first media placeholder (that item's media key in its place), or the first
  ``prefix_key_tokens`` tokens of a text-only prompt. The same image asked a new question, and every later turn of a
  conversation that began with it, lands on the replica that holds the image's KV blocks.

Choice (:meth:`AffinityTable.choose`): a key seen before goes to the replica it was placed on, unless that replica
has more than its share of the requests in flight — ``ceil(load_factor × (in flight + 1) / replicas)``, the bound of
consistent hashing with bounded loads — then to the least busy one (``spilled``; the key stays placed). A new key
goes to the first replica in its rendezvous order (highest hash of key and replica) whose share of the last
``window`` routed requests, and of those in flight, stays within the same bound, and is placed there: a mix of many
distinct images spreads evenly however the hashes fall, while the rendezvous order keeps two ingress replicas (each
with a table of its own) agreeing on a key's replica whenever load allows. A placed key whose replica is gone is
placed again (``moved``). The table holds ``capacity`` keys, least recently used dropped first.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Literal

Outcome = Literal["owner", "new", "moved", "spilled", "none"]
"""``owner``: to the replica the key was placed on; ``new``: a key placed now; ``moved``: placed again (its replica
left); ``spilled``: its replica was over the load bound or refused the call; ``none``: no key (least busy replica)."""

SAMPLE_BYTES = 64 * 1024


def media_key(scope: str, url: str) -> str:
    """A media reference's routing key within a cache scope (another tenant's copy of an image could not hit the
    cache, so it need not go to the same replica). For a ``data:`` URL: its length and its first and last 64 KiB —
    hashing a 16 MB URL whole would cost ~30 ms; two different images that agree in length, head and tail share a
    key, which costs affinity only."""
    raw = url.encode("utf-8", "surrogateescape")
    h = hashlib.sha256(b"prism-media-route\0" + scope.encode() + b"\0")
    if len(raw) > 2 * SAMPLE_BYTES:
        h.update(str(len(raw)).encode() + b"\0" + raw[:SAMPLE_BYTES] + raw[-SAMPLE_BYTES:])
    else:
        h.update(raw)
    return h.hexdigest()[:32]


def prefix_key(
    scope: str,
    token_ids: Sequence[int],
    placeholder_ids: frozenset[int],
    media_keys: Sequence[str],
    text_tokens: int,
) -> str:
    """The key of a prompt's start (see the module docstring); ``media_keys`` in the order of the placeholders."""
    h = hashlib.sha256(b"prism-prefix-route\0" + scope.encode() + b"\0")
    first = next((i for i, tok in enumerate(token_ids) if tok in placeholder_ids), None)
    end = min(len(token_ids), text_tokens) if first is None else first  # (however far into the prompt it comes)
    for tok in token_ids[:end]:
        h.update(b"t%d\0" % tok)
    if first is not None:
        h.update(b"m" + (media_keys[0] if media_keys else "").encode() + b"\0")
    return h.hexdigest()[:32]


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """Replicas in the key's rendezvous order: the same for every caller that sees the same replicas, and a replica
    leaving moves only the keys it was first for."""
    return sorted(replicas, key=lambda r: hashlib.sha256(f"{key}\0{r}".encode()).digest(), reverse=True)


def bound(load_factor: float, total: int, replicas: int) -> int:
    """The most one replica may carry once one more request is added: ``ceil(c × (total + 1) / n)``."""
    return max(1, math.ceil(load_factor * (total + 1) / max(1, replicas)))


class AffinityTable:
    """Placed keys, requests in flight and recent routes of one router (one ingress replica's view of a stage)."""

    def __init__(self, load_factor: float = 1.25, window: int = 256, capacity: int = 4096) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be ≥ 1")
        self.load_factor, self.capacity = load_factor, capacity
        self._placed: OrderedDict[str, str] = OrderedDict()
        self._recent: deque[str] = deque(maxlen=window)
        self._recent_count: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()

    def owner(self, key: str) -> str | None:
        return self._placed.get(key)

    def choose(self, key: str | None, replicas: Sequence[str]) -> tuple[list[str], Outcome]:
        """The replicas to try, best first, and what the first of them means for the key."""
        if not replicas:
            return [], "none"
        by_load = sorted(replicas, key=lambda r: (self.in_flight[r], self._recent_count[r]))
        if key is None:
            return by_load, "none"
        cap = bound(self.load_factor, sum(self.in_flight[r] for r in replicas), len(replicas))
        placed = self._placed.get(key)
        if placed in replicas:
            if self.in_flight[placed] + 1 <= cap:
                return [placed] + [r for r in by_load if r != placed], "owner"
            return [r for r in by_load if r != placed] + [placed], "spilled"
        recent_cap = bound(self.load_factor, sum(self._recent_count[r] for r in replicas), len(replicas))
        order = rendezvous(key, replicas)
        for r in order:
            if self.in_flight[r] + 1 <= cap and self._recent_count[r] + 1 <= recent_cap:
                return [r] + [x for x in order if x != r], "moved" if placed is not None else "new"
        return by_load, "moved" if placed is not None else "new"

    def routed(self, key: str | None, replica: str, place: bool) -> None:
        """A call is in flight at ``replica``; ``place`` pins the key there (a new or moved key, wherever it was
        accepted)."""
        self.in_flight[replica] += 1
        if len(self._recent) == self._recent.maxlen:
            self._recent_count[self._recent[0]] -= 1
        self._recent.append(replica)
        self._recent_count[replica] += 1
        if key is None:
            return
        if place:
            self._placed[key] = replica
        if key in self._placed:
            self._placed.move_to_end(key)
            while len(self._placed) > self.capacity:
                self._placed.popitem(last=False)

    def completed(self, replica: str) -> None:
        if self.in_flight[replica] > 0:
            self.in_flight[replica] -= 1

    def forget(self, replica: str) -> None:
        """A replica left: nothing is in flight there any more; its keys are placed again when next seen."""
        self.in_flight.pop(replica, None)
