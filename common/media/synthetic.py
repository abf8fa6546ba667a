"""Deterministic synthetic images and PyAV video clips for demos, tests and benchmarks (no data hub is reachable).

Images have structure (gradients, shapes, noise) rather than flat colour, so different seeds give different vision
features and different answers — flat images would make cache-key bugs invisible.
"""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image, ImageDraw


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    # A horizontal gradient in red, a vertical one in green, a flat blue drawn from the seed, plus Gaussian noise.
    # Built in place on the noise array, channel by channel (the gradients as one row and one column broadcast):
    # the same float32 gradients and float64 sums as stacking full-size planes, so the same pixels, in well under
    # half the time and memory — a large image is drawn before every timed load the bench plans.
    blue = rng.integers(0, 256)
    img_f = rng.normal(0, 24, size=(height, width, 3))
    img_f[..., 0] += 255 * (np.arange(width, dtype=np.float32) / max(1, width - 1))
    img_f[..., 1] += (255 * (np.arange(height, dtype=np.float32) / max(1, height - 1)))[:, None]
    img_f[..., 2] += np.float32(blue)
    np.clip(img_f, 0, 255, out=img_f)
    return draw_shapes(Image.fromarray(img_f.astype(np.uint8), "RGB"), rng)


def draw_shapes(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Four ellipses or rectangles of random colours drawn on ``img`` (in place; returned), from ``rng``."""
    width, height = img.size
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(8, max(9, width // 2))), y0 + int(rng.integers(8, max(9, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    return img


def video_bytes(seconds: float, fps: int = 10, size: tuple[int, int] = (64, 48), fmt: str = "mp4") -> bytes:
    """A real clip made with PyAV: MP4/H.264 or WebM/VP8, frames with a moving bar so frames differ."""
    buf = io.BytesIO()
    codec = "libx264" if fmt == "mp4" else "libvpx"
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            arr = np.full((size[1], size[0], 3), 40, np.uint8)
            x = (i * 4) % size[0]
            arr[:, x : x + 4] = 250
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
