"""Deterministic synthetic images for demos, tests and benchmarks (no data hub is reachable).

Images have structure (gradients, shapes, noise) rather than flat colour, so different seeds give different vision
features and different answers — flat images would make cache-key bugs invisible.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            255 * (x / max(1, width - 1)),
            255 * (y / max(1, height - 1)),
            np.full_like(x, rng.integers(0, 256)),
        ],
        axis=-1,
    )
    noise = rng.normal(0, 24, size=base.shape)
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(8, max(9, width // 2))), y0 + int(rng.integers(8, max(9, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    return img
