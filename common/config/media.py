"""Media limits and fetch policy (``media:`` section of the config).

Defaults are safe: public internet only over http(s) and data URLs, no ``file://`` until an operator sets a root,
bounded bytes, pixels, frames and durations. ``allowed_private_networks`` opens listed private CIDRs (tests, on-prem
object stores); the environment variable ``PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS`` (comma-separated CIDRs) adds to it
when the config is loaded — never at import.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ENV_PRIVATE_NETWORKS = "PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS"

RASTER_MIME = ("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp")
VIDEO_MIME = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska")


class VideoPolicy(BaseModel):
    """Server-side video caps; a request may lower them, never raise them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fps: float = Field(default=2.0, gt=0, le=30)
    """Frames sampled per second of video."""
    max_frames: int = Field(default=32, ge=1, le=1024)
    """Frames sampled at most (evenly over the clip when fps would give more)."""
    max_duration_s: float = Field(default=300.0, gt=0)
    """Longer videos are refused (413) before any frame is decoded."""
    max_decoded_frames: int = Field(default=20_000, ge=1)
    """Hard stop on frames decoded while sampling (guards streams whose declared duration lies)."""
    allowed_codecs: tuple[str, ...] = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
    """Video codecs accepted (FFmpeg names)."""
    allowed_containers: tuple[str, ...] = ("mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm")
    """Container formats accepted (FFmpeg demuxer names)."""


class MediaConfig(BaseModel):
    """Fetch policy and limits for images and videos."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_schemes: tuple[str, ...] = ("https", "http", "data")
    """URL schemes accepted; ``file`` also needs ``file_root``."""
    file_root: str | None = None
    """Directory that ``file://`` URLs must resolve into (after symlinks); ``None`` disables ``file://``."""
    allowed_domains: tuple[str, ...] = ()
    """If non-empty, only these hosts (and their subdomains) may be fetched."""
    denied_domains: tuple[str, ...] = ()
    """Hosts (and subdomains) never fetched."""
    allowed_private_networks: tuple[str, ...] = ()
    """CIDRs that may be fetched although not globally routable (plus ``PRISM_MEDIA_ALLOWED_PRIVATE_NETWORKS``)."""
    max_items_per_request: int = Field(default=8, ge=0)
    """Images + videos in one request."""
    max_item_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    """Encoded bytes of one item (download cap; data-URL payload cap)."""
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    """Encoded bytes of all items of one request together."""
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    """width × height of an image (or a video frame), checked from the header before decoding."""
    max_animation_frames: int = Field(default=512, ge=1)
    """Frames in an animated GIF/WebP/PNG, counted without decoding."""
    max_redirects: int = Field(default=5, ge=0, le=10)
    """HTTP redirects followed (each hop re-checked)."""
    dns_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for a media host's name to resolve (the system resolver has no timeout of its own: lookups run on
    a small pool of their own and are abandoned past this, 504 ``media_fetch_timeout``)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """TCP/TLS connect timeout per hop."""
    read_timeout_s: float = Field(default=10.0, gt=0)
    """Longest wait for any single read."""
    total_timeout_s: float = Field(default=30.0, gt=0)
    """Whole fetch, redirects included."""
    background_rgb: tuple[int, int, int] = (255, 255, 255)
    """Colour transparent images are composited on."""
    video: VideoPolicy = VideoPolicy()
    """Video frame-sampling policy and caps."""

    @model_validator(mode="before")
    @classmethod
    def _env_networks(cls, data: Any) -> Any:
        env = os.environ.get(ENV_PRIVATE_NETWORKS, "").strip()
        if not env:
            return data
        data = dict(data or {})
        extra = [c.strip() for c in env.split(",") if c.strip()]
        data["allowed_private_networks"] = tuple(data.get("allowed_private_networks", ())) + tuple(extra)
        return data

    @field_validator("allowed_private_networks")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in v:
            ipaddress.ip_network(cidr, strict=False)  # raises ValueError with the bad value
        return v

    @field_validator("allowed_domains", "denied_domains")
    @classmethod
    def _domains(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d.strip().lower().rstrip(".") for d in v if d.strip())

    @property
    def max_data_url_chars(self) -> int:
        """Longest base64 payload that can decode to ``max_item_bytes`` (checked before decoding)."""
        return 4 * (-(-self.max_item_bytes // 3))
