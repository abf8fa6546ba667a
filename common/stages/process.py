"""Process stage: decoded RGB images → :class:`ProcessedMedia` via the family's PIL image processor.

The media stage (fetch, sniff, decode, limits) hands over PIL images and the digest of their fetched bytes. For
images made in-process (tests, batch frames) :func:`pixel_digest` gives a digest of the decoded pixels instead.

With a :class:`ProcessorCache`, the processor runs once per (tenant, digest, processor revision, options): a hit
returns the arrays a recompute would give. ``options`` must hold every decode option that shaped the image before it
got here (background colour, orientation handling …), since the digest covers the *fetched* bytes only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from PIL import Image

from common.cache.processor_cache import ProcessorCache
from common.model.loader import ModelFrontend
from common.protocol.handoff import ProcessedMedia


def pixel_digest(image: Image.Image) -> str:
    """Content digest of a decoded image (mode, size and pixels)."""
    h = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}\0".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def process_images(
    lm: ModelFrontend,
    images: Sequence[Image.Image],
    digests: Sequence[str] | None = None,
    *,
    cache: ProcessorCache | None = None,
    tenant: str = "default",
    options: dict[str, Any] | None = None,
) -> list[ProcessedMedia]:
    """Run the family processor over each image; ``media_index`` follows the order given."""
    if digests is not None and len(digests) != len(images):
        raise ValueError("one digest per image")
    out = []
    for i, image in enumerate(images):
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        digest = digests[i] if digests is not None else pixel_digest(rgb)
        key = None
        px = None
        if cache is not None:
            key = cache.key(
                tenant,
                digest,
                type(lm.image_processor).__name__,
                lm.contract.processor_revision,
                options or {},
                "float32",
            )
            px = cache.get(key)
        if px is None:
            px = lm.adapter.process_image(lm.image_processor, lm.config, rgb)
            if cache is not None and key is not None:
                cache.put(key, px)
        out.append(
            ProcessedMedia(
                media_index=i,
                modality="image",
                media_digest=digest,
                pixel_values=px.pixel_values,
                grid_thw=px.grid_thw,
                num_visual_tokens=px.num_visual_tokens,
                source_size=(image.width, image.height),
            )
        )
    return out
