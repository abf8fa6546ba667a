"""Chained block hashes for the multimodal prefix cache.

Block ``i`` covers prompt positions ``[i·B, (i+1)·B)``. Its hash chains the previous block's hash with this block's
content, where a text position contributes its token id and a visual position contributes ``(media_digest, offset
inside that media's span)`` — never the placeholder id, which is the same for every image (hashing placeholders is
how a cache serves one image's KV for another; vLLM #20261). The chain's root binds the model revision (weights,
config) and the tenant scope, so a hit can never cross models or tenants (unless the operator shares a scope).
Only full blocks are hashed; a partially filled last block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from common.protocol.handoff import PlaceholderSpan


def block_hashes(
    token_ids: np.ndarray,
    spans: Sequence[PlaceholderSpan],
    block_size: int,
    model_revision: str,
    scope: str,
) -> list[bytes]:
    """One hash per *full* block of the prompt, each covering everything before it."""
    n_full = len(token_ids) // block_size
    media_at: dict[int, tuple[str, int]] = {}
    for span in spans:
        for off in range(span.prompt_token_length):
            media_at[span.prompt_token_start + off] = (span.media_digest, off)
    prev = hashlib.sha256(f"prism-prefix-v1\0{model_revision}\0{scope}".encode()).digest()
    out = []
    for b in range(n_full):
        h = hashlib.sha256(prev)
        for pos in range(b * block_size, (b + 1) * block_size):
            media = media_at.get(pos)
            if media is None:
                h.update(b"t" + struct.pack("<q", int(token_ids[pos])))
            else:
                h.update(b"m" + media[0].encode() + struct.pack("<q", media[1]))
        prev = h.digest()
        out.append(prev)
    return out
