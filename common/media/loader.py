"""The media stage's core: request media references → decoded RGB images / sampled video frames.

Limits come in two layers so hostile input costs nothing:

1. :func:`check_request` — before **any** fetch: number of items, schemes, data-URL payload lengths (before base64
   decoding) and their declared types, and the request's total data-URL bytes. A bad third item means no fetch of
   the first two.
2. Per item, after fetching (which itself stops at the byte cap): the format by magic bytes, then header-only checks
   (pixels, animation frames, video codec/size/duration) — :func:`fetch_media`, whose :class:`CheckedMedia` say
   what decoding will cost — and only then decoding (:func:`decode_media`). The media stage admits the decode
   against its pixel budget in between.

The request-wide byte budget shrinks as items arrive, so N items cannot each take the per-item cap when the request
cap is lower.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from PIL import Image

from common.config.media import RASTER_MIME, VIDEO_MIME, MediaConfig
from common.errors import InvalidMedia, MediaFetchBlocked, MediaTooLarge, TooManyMediaItems
from common.media.fetch import MediaFetcher
from common.media.image import decode_image, inspect_image
from common.media.sniff import sniff
from common.media.video import decode_video, inspect_video
from common.protocol.handoff import MediaRef
from common.stop import NEVER, Stop


@dataclass(frozen=True)
class LoadedMedia:
    """Decoded media: one image, or a video's sampled frames, plus the digest of the fetched bytes."""

    kind: Literal["image", "video"]
    digest: str
    format: str
    nbytes: int
    frames: list[Image.Image]
    timestamps_s: list[float] = field(default_factory=list)

    @property
    def image(self) -> Image.Image:
        return self.frames[0]


@dataclass
class LoadTimings:
    """Seconds spent fetching and decoding a request's items (summed over items), for its trace."""

    fetch_s: float = 0.0
    decode_s: float = 0.0
    nbytes: int = 0


def check_request(refs: Sequence[MediaRef], cfg: MediaConfig) -> None:
    """Layer-1 limits; raises before anything is fetched or decoded."""
    if len(refs) > cfg.max_items_per_request:
        raise TooManyMediaItems(
            f"request has {len(refs)} media items; the limit is {cfg.max_items_per_request}", param="messages"
        )
    data_chars = 0
    for i, ref in enumerate(refs):
        scheme = ref.url.split(":", 1)[0].strip().lower() if ":" in ref.url else ""
        if scheme not in cfg.allowed_schemes or (scheme == "file" and not cfg.file_root):
            raise MediaFetchBlocked(f"media item {i}: URL scheme {scheme or '(none)'!r} is not allowed", param="url")
        if scheme != "data":
            continue
        header, _, payload = ref.url[5:].partition(",")
        mime = header.split(";", 1)[0].strip().lower()
        allowed = RASTER_MIME if ref.kind == "image" else VIDEO_MIME
        if mime not in allowed:
            raise InvalidMedia(f"media item {i}: data URL type {mime!r} is not an accepted {ref.kind} type")
        if len(payload) > cfg.max_data_url_chars:
            raise MediaTooLarge(
                f"media item {i}: data URL payload is {len(payload)} characters; the limit is {cfg.max_data_url_chars}"
            )
        data_chars += len(payload)
    if data_chars * 3 // 4 > cfg.max_request_bytes:
        raise MediaTooLarge(f"request's data URLs decode to more than {cfg.max_request_bytes} bytes")


@dataclass(frozen=True)
class CheckedMedia:
    """One fetched item whose format and header passed: what decoding it will cost is known, nothing is decoded."""

    ref: MediaRef
    digest: str
    format: str
    modality: Literal["image", "video"]
    data: bytes
    pixels: int
    """Pixels decoding will produce: width × height (× the frames a video will be sampled at)."""


def fetch_media(
    refs: Sequence[MediaRef],
    cfg: MediaConfig,
    fetcher: MediaFetcher,
    timings: LoadTimings | None = None,
    stop: Stop = NEVER,
) -> list[CheckedMedia]:
    """Layer 1, then fetch, sniff and header-check every item in order (no pixel decoded)."""
    check_request(refs, cfg)
    timings = timings if timings is not None else LoadTimings()
    budget = cfg.max_request_bytes
    out = []
    for i, ref in enumerate(refs):
        stop.check("the media fetch")
        if budget <= 0:
            raise MediaTooLarge(f"request media exceed {cfg.max_request_bytes} bytes in total")
        t0 = time.perf_counter()
        fetched = fetcher.fetch(ref.url, max_bytes=min(budget, cfg.max_item_bytes), stop=stop)
        timings.fetch_s += time.perf_counter() - t0
        timings.nbytes += len(fetched.data)
        budget -= len(fetched.data)
        modality, fmt = sniff(fetched.data)
        if modality != ref.kind:
            raise InvalidMedia(f"media item {i} was sent as {ref.kind} but its bytes are a {modality} ({fmt})")
        if modality == "image":
            header = inspect_image(fetched.data, fmt, cfg)
            pixels = header.width * header.height
        else:
            pixels = inspect_video(fetched.data, fmt, cfg, fps=ref.fps, max_frames=ref.max_frames)
        out.append(CheckedMedia(ref, fetched.digest, fmt, modality, fetched.data, pixels))
    return out


def decode_media(
    checked: Sequence[CheckedMedia], cfg: MediaConfig, timings: LoadTimings | None = None, stop: Stop = NEVER
) -> list[LoadedMedia]:
    """Decode header-checked items (stopping between items and video frames when ``stop`` says so)."""
    timings = timings if timings is not None else LoadTimings()
    out = []
    for item in checked:
        stop.check("media decoding")
        t0 = time.perf_counter()
        if item.modality == "image":
            frames, stamps = [decode_image(item.data, item.format, cfg)], []
        else:
            ref = item.ref
            video = decode_video(item.data, item.format, cfg, fps=ref.fps, max_frames=ref.max_frames, stop=stop)
            frames, stamps = video.frames, video.timestamps_s
        timings.decode_s += time.perf_counter() - t0
        out.append(
            LoadedMedia(
                kind=item.modality,
                digest=item.digest,
                format=item.format,
                nbytes=len(item.data),
                frames=frames,
                timestamps_s=stamps,
            )
        )
    return out


def load_media(
    refs: Sequence[MediaRef], cfg: MediaConfig, fetcher: MediaFetcher, timings: LoadTimings | None = None
) -> list[LoadedMedia]:
    """Check, fetch, sniff, header-check and decode every item, in order (adding to ``timings`` if given)."""
    timings = timings if timings is not None else LoadTimings()
    return decode_media(fetch_media(refs, cfg, fetcher, timings), cfg, timings)
