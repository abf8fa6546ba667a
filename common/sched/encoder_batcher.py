"""Encoder batching by shape bucket and patch budget, with aging and traffic class.

Items wait in one pool. The next batch starts from the item of lowest *rank* (:func:`common.admission.budget.rank`, the
same rule as the encode gate and the prefill lanes): its arrival + ``patches / aging_rate`` seconds, + ``batch_delay_s``
for batch traffic. Small images go first (they finish fast and unblock their requests' prefill), but a large image
is overtaken only by work that arrived less than ``patches / aging_rate`` seconds after it — it is never starved; a
batch-class item (``priority: batch``) also lets interactive items that arrived up to ``batch_delay_s`` after it go
first, and is never starved either. The batch is then filled, in the same order, with items of the same shape
bucket (modality + power-of-two patch class) up to the patch budget; the first item is always taken even if it alone
exceeds the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.admission.budget import rank
from common.protocol.handoff import ProcessedMedia


@dataclass(frozen=True)
class EncodeItem:
    request_id: str
    media: ProcessedMedia
    arrival_s: float
    batch: bool = False
    """Batch-class traffic (``priority: batch``): ranked ``batch_delay_s`` behind interactive."""

    @property
    def patches(self) -> int:
        return self.media.patches

    @property
    def bucket(self) -> tuple[str, int]:
        return self.media.modality, math.ceil(math.log2(max(1, self.patches)))


class EncoderBatcher:
    def __init__(
        self,
        patch_budget: int = 8192,
        max_items: int = 32,
        aging_patches_per_s: float = 2048.0,
        batch_delay_s: float = 0.0,
    ) -> None:
        if aging_patches_per_s <= 0:
            raise ValueError("aging_patches_per_s must be > 0 (it divides an item's patches into seconds)")
        self.patch_budget = patch_budget
        self.max_items = max_items
        self.aging = aging_patches_per_s
        self.batch_delay_s = batch_delay_s
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
        # (``now_s`` is the same for every item: ordering by rank is ordering by patches − aging × seconds waited)
        order = sorted(
            self._items,
            key=lambda i: (rank(i.arrival_s, i.patches, self.aging, i.batch, self.batch_delay_s), i.arrival_s),
        )
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
