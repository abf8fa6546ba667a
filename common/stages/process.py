"""Process stage: decoded RGB images and sampled video frames → :class:`ProcessedMedia` via the family's processor.

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
from common.errors import InvalidRequestError
from common.media.loader import LoadedMedia
from common.model.loader import ModelFrontend
from common.protocol.handoff import Modality, ProcessedMedia


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
    return [
        _process_one(lm, i, "image", [img], digests[i] if digests is not None else None, cache, tenant, options or {})
        for i, img in enumerate(images)
    ]


def process_loaded(
    lm: ModelFrontend,
    media: Sequence[LoadedMedia],
    *,
    cache: ProcessorCache | None = None,
    tenant: str = "default",
    options: dict[str, Any] | None = None,
) -> list[ProcessedMedia]:
    """The media stage's output (images and sampled videos, with fetched-bytes digests) → processed items."""
    out = []
    for i, item in enumerate(media):
        opts = dict(options or {})
        if item.kind == "video":  # which frames were sampled shapes the pixels as much as the bytes do
            opts["frame_timestamps_s"] = [round(t, 6) for t in item.timestamps_s]
        out.append(_process_one(lm, i, item.kind, item.frames, item.digest, cache, tenant, opts))
    return out


def _process_one(
    lm: ModelFrontend,
    index: int,
    modality: Modality,
    frames: Sequence[Image.Image],
    digest: str | None,
    cache: ProcessorCache | None,
    tenant: str,
    options: dict[str, Any],
) -> ProcessedMedia:
    rgb = [f if f.mode == "RGB" else f.convert("RGB") for f in frames]
    if digest is None:
        digest = pixel_digest(rgb[0]) if modality == "image" else _frames_digest(rgb)
    key = None
    px = None
    if cache is not None:
        opts = {**options, "modality": modality}
        processor = type(lm.image_processor).__name__
        key = cache.key(tenant, digest, processor, lm.contract.processor_revision, opts, "float32")
        px = cache.get(key)
    if px is None:
        if modality == "image":
            px = lm.adapter.process_image(lm.image_processor, lm.config, rgb[0])
        else:
            if modality not in lm.adapter.modalities:
                raise InvalidRequestError(f"model {lm.served_name} does not accept {modality} input", param="messages")
            px = lm.adapter.process_video(lm.image_processor, lm.config, list(rgb), lm.video_bounds)
        if cache is not None and key is not None:
            cache.put(key, px)
    return ProcessedMedia(
        media_index=index,
        modality=modality,
        media_digest=digest,
        pixel_values=px.pixel_values,
        grid_thw=px.grid_thw,
        num_visual_tokens=px.num_visual_tokens,
        source_size=(frames[0].width, frames[0].height),
    )


def _frames_digest(frames: Sequence[Image.Image]) -> str:
    h = hashlib.sha256()
    for f in frames:
        h.update(pixel_digest(f).encode())
    return h.hexdigest()
