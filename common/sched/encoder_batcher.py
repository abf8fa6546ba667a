"""Encoder batching by shape bucket and patch budget, with aging.

Items wait in one pool. The next batch starts from the item with the lowest *effective cost*
``patches − aging_rate × seconds_waited``: small images go first (they finish fast and unblock their requests'
prefill), but every second of waiting lowers a large image's cost, so a stream of small images can delay a large
one by at most ``patches / aging_rate`` seconds — it is never starved. The batch is then filled, in the same order,
with items of the same shape bucket (modality + power-of-two patch class) up to the patch budget; the first item is
always taken even if it alone exceeds the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.protocol.handoff import ProcessedMedia


@dataclass(frozen=True)
class EncodeItem:
    request_id: str
    media: ProcessedMedia
    arrival_s: float

    @property
    def patches(self) -> int:
        return self.media.patches

    @property
    def bucket(self) -> tuple[str, int]:
        return self.media.modality, math.ceil(math.log2(max(1, self.patches)))


class EncoderBatcher:
    def __init__(self, patch_budget: int = 8192, max_items: int = 32, aging_patches_per_s: float = 2048.0) -> None:
        self.patch_budget = patch_budget
        self.max_items = max_items
        self.aging = aging_patches_per_s
        self._items: list[EncodeItem] = []

    def add(self, item: EncodeItem) -> None:
        self._items.append(item)

    def remove_request(self, request_id: str) -> int:
        before = len(self._items)
        self._items = [i for i in self._items if i.request_id != request_id]
        return before - len(self._items)

    @property
    def pending_items(self) -> int:
        return len(self._items)

    @property
    def pending_patches(self) -> int:
        """Queue depth in patches: the encode stage's autoscaling signal."""
        return sum(i.patches for i in self._items)

    def next_batch(self, now_s: float) -> list[EncodeItem]:
        if not self._items:
            return []
        order = sorted(self._items, key=lambda i: (i.patches - self.aging * (now_s - i.arrival_s), i.arrival_s))
        bucket = order[0].bucket
        batch, patches = [], 0
        for item in order:
            if item.bucket != bucket or len(batch) >= self.max_items:
                continue
            if batch and patches + item.patches > self.patch_budget:
                continue
            batch.append(item)
            patches += item.patches
        chosen = {id(i) for i in batch}
        self._items = [i for i in self._items if id(i) not in chosen]
        return batch
