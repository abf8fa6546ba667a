"""Image header check and decode: bytes → one RGB ``PIL.Image`` (the first frame of an animation).

Two steps, so hostile files cost nothing:

1. :func:`inspect_image` opens the file lazily (Pillow reads only the header), restricted to the sniffed format,
   and checks width × height against ``max_image_pixels`` and the frame count against ``max_animation_frames``
   before a single pixel is decoded. Prism never relies on Pillow's global ``MAX_IMAGE_PIXELS`` — but
   :func:`check_pillow_guard` refuses to start if something disabled it or enabled truncated-image loading.
2. :func:`decode_image` loads pixels, applies EXIF orientation, composites transparency (RGBA/LA/P/PA) on the
   configured background, and converts CMYK, 16-bit, float, 1-bit and grey images to 8-bit RGB.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

from common.config.media import MediaConfig
from common.errors import InvalidMedia, MediaTooLarge
from common.media.sniff import count_frames


def check_pillow_guard() -> None:
    """Raise if Pillow's own bomb guard is disabled or truncated images are accepted (call at start-up)."""
    if Image.MAX_IMAGE_PIXELS is None:
        raise RuntimeError("PIL.Image.MAX_IMAGE_PIXELS is None: Pillow's decompression-bomb guard is disabled")
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on: truncated images would decode silently")


@dataclass(frozen=True)
class ImageHeader:
    format: str
    width: int
    height: int
    frames: int
    mode: str


def _open(data: bytes, fmt: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaTooLarge(f"image dimensions are too large: {exc}") from exc
    except Exception as exc:  # Pillow raises many types for corrupt headers
        raise InvalidMedia(f"{fmt} image header cannot be read: {type(exc).__name__}") from exc


def inspect_image(data: bytes, fmt: str, cfg: MediaConfig) -> ImageHeader:
    """Header-only checks; decodes no pixels."""
    img = _open(data, fmt)
    width, height = img.size
    if width <= 0 or height <= 0:
        raise InvalidMedia("image has zero width or height")
    if width * height > cfg.max_image_pixels:
        raise MediaTooLarge(f"image is {width}×{height} = {width * height} pixels; the limit is {cfg.max_image_pixels}")
    frames = count_frames(data, fmt, cfg.max_animation_frames)
    if frames > cfg.max_animation_frames:
        raise MediaTooLarge(f"animated image has more than {cfg.max_animation_frames} frames")
    return ImageHeader(format=fmt, width=width, height=height, frames=frames, mode=img.mode)


def decode_image(data: bytes, fmt: str, cfg: MediaConfig) -> Image.Image:
    """Checked header, then pixels → RGB (first frame of an animation)."""
    inspect_image(data, fmt, cfg)
    img = _open(data, fmt)
    try:
        img.seek(0)
        img.load()
        img = ImageOps.exif_transpose(img)
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidMedia(f"{fmt} image data is corrupt or truncated: {exc}") from exc
    return to_rgb(img, cfg.background_rgb)


def to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Any Pillow mode → 8-bit RGB, transparency composited on ``background``."""
    mode = img.mode
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode == "PA":
        img = img.convert("RGBA")
    elif mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        img = Image.fromarray(np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    if img.mode != "RGB":
        img = img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV
    return img
