"""Workloads: what each request of a load run asks, built before the run (deterministic for a seed).

A workload mixes request kinds by weight — ``text`` (no media), ``image`` (one image), ``multi_image`` (two to four)
and ``video`` (a short PyAV clip; needs a video-capable model) — with images drawn from size buckets by weight
(``small`` 224², ``medium`` 640×480, ``large`` 1920×1440, sent as JPEG data URLs). The cache regime decides whether
media repeat: ``cold`` (every image unique), ``hot`` (``hot_images`` images per bucket and seed — one unless set —
drawn at random and repeated) or ``partial`` (each image reused from the hot set with probability ``reuse``). With
``fresh_questions`` every request's question is one never asked before (a numbered variant): a repeated image is
then asked something new, as in a conversation about one picture, and only the prompt up to the question repeats.
Output lengths follow ``fixed:N``, ``uniform:A-B`` or ``exp:MEAN`` (capped at 4×MEAN); requests ask for exactly that
many tokens (``ignore_eos`` is not needed: the tiny models rarely stop early, and the records keep the real count).
"""

from __future__ import annotations

import base64
import io
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from common.media.synthetic import synthetic_image, video_bytes

BUCKETS: dict[str, tuple[int, int]] = {"small": (224, 224), "medium": (640, 480), "large": (1920, 1440)}
Kind = Literal["text", "image", "multi_image", "video"]
RENDER_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Threads that draw a planned load's unique images (:meth:`Workload.next_requests`): a plan is built before its
clock starts, while the server is idle, and drawing (numpy, Pillow) releases the GIL — one flood of large images took
11 s on one thread here, about half that on two."""
PROMPTS = ("Describe the image.", "What is in the picture?", "Summarise what you see.", "Tell me a short story.")


def parse_weights(text: str, allowed: tuple[str, ...]) -> dict[str, float]:
    """``"text=0.5,image=0.5"`` → weights (unknown names refused)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in allowed:
            raise ValueError(f"unknown name {name!r}; expected one of {', '.join(allowed)}")
        out[name] = float(value)
        if out[name] < 0:
            raise ValueError(f"weight of {name} must be ≥ 0")
    if not out or sum(out.values()) <= 0:
        raise ValueError("at least one positive weight is needed")
    return out


@dataclass(frozen=True)
class OutputLengths:
    spec: str = "fixed:32"

    def sample(self, rng: random.Random) -> int:
        kind, _, arg = self.spec.partition(":")
        if kind == "fixed":
            return max(1, int(arg))
        if kind == "uniform":
            lo, _, hi = arg.partition("-")
            return rng.randint(int(lo), int(hi))
        if kind == "exp":
            mean = float(arg)
            return max(1, min(int(4 * mean), round(rng.expovariate(1.0 / mean))))
        raise ValueError(f"output lengths {self.spec!r}: use fixed:N, uniform:A-B or exp:MEAN")


@dataclass
class Workload:
    mix: dict[str, float] = field(default_factory=lambda: {"text": 0.5, "image": 0.5})
    sizes: dict[str, float] = field(default_factory=lambda: {"small": 0.5, "medium": 0.4, "large": 0.1})
    cache: Literal["cold", "hot", "partial"] = "cold"
    reuse: float = 0.5
    outputs: OutputLengths = field(default_factory=OutputLengths)
    video_seconds: float = 2.0
    seed: int = 0
    hot_images: int = 1
    """Size of the hot set per bucket (``hot`` and ``partial``)."""
    fresh_questions: bool = False
    image_seed: int | None = None
    """Decides the images alone (default: ``seed``). With its own value, the requests are ``seed``'s — the same
    kinds, sizes, reuses, questions and lengths — drawn with images of their own: the goodput sweep sends one sequence
    at every rate, each run's images cold."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._images = self.seed if self.image_seed is None else self.image_seed
        self._unique = 0
        self._asked = 0
        self._url_cache: dict[tuple[str, int], str] = {}
        self._deferred: list[tuple[dict[str, str], str, int]] | None = None

    def next_requests(self, model: str, count: int, threads: int = RENDER_THREADS) -> list[tuple[str, dict[str, Any]]]:
        """The next ``count`` requests: the same as ``count`` calls of :meth:`next_request` (the same draws, in the same
        order), with the unique images drawn afterwards on ``threads`` threads."""
        self._deferred = []
        try:
            out = [self.next_request(model) for _ in range(count)]
        finally:
            deferred, self._deferred = self._deferred, None
        if deferred:  # (text-only loads defer nothing: no pool to start)
            with ThreadPoolExecutor(max(1, threads)) as pool:
                for part, url in zip(deferred, pool.map(lambda d: self._image_url(d[1], d[2]), deferred), strict=True):
                    part[0]["url"] = url
        return out

    def next_request(self, model: str) -> tuple[str, dict[str, Any]]:
        """(kind, OpenAI chat body) of the next request."""
        kind = self._pick(self.mix)
        content: list[dict[str, Any]] = []
        if kind == "image":
            content.append(self._image_part())
        elif kind == "multi_image":
            content.extend(self._image_part() for _ in range(self.rng.randint(2, 4)))
        elif kind == "video":
            content.append({"type": "video_url", "video_url": {"url": self._video_url()}})
        question = self.rng.choice(PROMPTS)
        if self.fresh_questions:
            self._asked += 1
            question = f"{question} (question {self._asked})"
        content.append({"type": "text", "text": question})
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content if kind != "text" else content[-1]["text"]}],
            "max_tokens": self.outputs.sample(self.rng),
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},  # output tokens from the server's count, as vLLM's bench does
        }
        return kind, body

    def _pick(self, weights: dict[str, float]) -> str:
        names = list(weights)
        return self.rng.choices(names, weights=[weights[n] for n in names])[0]

    def _image_part(self) -> dict[str, Any]:
        bucket = self._pick(self.sizes)
        hot = self.cache == "hot" or (self.cache == "partial" and self.rng.random() < self.reuse)
        if hot:  # the hot set is this workload's seed's own: another seed's run starts with cold caches
            seed = self._hot_seed(bucket, self.rng.randrange(self.hot_images) if self.hot_images > 1 else 0)
        else:
            self._unique += 1
            seed = self._images * 1_000_003 + self._unique
            if self._deferred is not None:  # (a unique image depends on its seed only: drawn later, in parallel)
                holder: dict[str, str] = {}
                self._deferred.append((holder, bucket, seed))
                return {"type": "image_url", "image_url": holder}
        return {"type": "image_url", "image_url": {"url": self._image_url(bucket, seed)}}

    def _hot_seed(self, bucket: str, j: int) -> int:
        return -1 - list(BUCKETS).index(bucket) - len(BUCKETS) * (self._images * self.hot_images + j)

    def hot_set(self, bucket: str) -> list[str]:
        """The data URLs of the bucket's hot images (to warm a cache with before a timed run)."""
        return [self._image_url(bucket, self._hot_seed(bucket, j)) for j in range(self.hot_images)]

    def _image_url(self, bucket: str, seed: int) -> str:
        key = (bucket, seed)
        if key not in self._url_cache:
            buf = io.BytesIO()
            synthetic_image(*BUCKETS[bucket], seed=abs(seed)).save(buf, "JPEG", quality=90)
            url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
            if seed >= 0:  # unique images are used once: do not keep them
                return url
            self._url_cache[key] = url
        return self._url_cache[key]

    def _video_url(self) -> str:
        key = ("video", 0)
        if key not in self._url_cache:
            data = video_bytes(self.video_seconds, fps=8, size=(160, 120))
            self._url_cache[key] = "data:video/mp4;base64," + base64.b64encode(data).decode()
        return self._url_cache[key]
