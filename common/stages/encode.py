"""Encode stage: processed media → one :class:`VisualEmbeddings` block per item (vision tower + projector).

Items are encoded in one forward call (the family batches them the way its ``generate()`` would). Embeddings leave
as float32 numpy: bf16/fp16 → fp32 is exact, so merge can cast back to the model dtype without changing a bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.errors import HandoffError
from common.model.loader import LoadedModel
from common.protocol.handoff import ProcessedMedia, VisualEmbeddings


def encode_media(lm: LoadedModel, items: Sequence[ProcessedMedia]) -> list[VisualEmbeddings]:
    if not items:
        return []
    with torch.inference_mode():
        blocks = lm.adapter.encode(lm.model, list(items))
    out = []
    for item, block in zip(items, blocks, strict=True):
        emb = block.float().numpy()
        if emb.shape != (item.num_visual_tokens, lm.hidden_size):
            raise HandoffError(
                f"media #{item.media_index}: encoder produced {emb.shape}, "
                f"processor promised ({item.num_visual_tokens}, {lm.hidden_size})"
            )
        out.append(
            VisualEmbeddings(
                media_index=item.media_index,
                modality=item.modality,
                media_digest=item.media_digest,
                embeddings=np.ascontiguousarray(emb),
                grid_thw=item.grid_thw,
                encoder_revision=lm.contract.encoder_key,
            )
        )
    return out
