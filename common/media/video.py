"""Video header check and frame sampling with PyAV.

The demuxer is forced from the sniffed format (``mov`` for MP4/MOV, ``matroska`` for MKV/WebM) so FFmpeg never
probes its way into a playlist or concat demuxer that could open other files or URLs. Then, before any frame is
decoded: exactly one video stream, an allowed codec, frame size within ``max_image_pixels`` and duration within the
server's ``max_duration_s``. Sampling takes frames at the effective fps (evenly spread over the clip when that
would exceed the effective ``max_frames``); a request may lower the server's fps / max_frames, never raise them.
Decoding stops at ``max_decoded_frames`` or when frames run past the allowed duration (a lying header).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
from PIL import Image

from common.config.media import MediaConfig, VideoPolicy
from common.errors import InvalidMedia, MediaTooLarge
from common.stop import NEVER, Stop

_DEMUXER = {"MP4": "mov", "MATROSKA": "matroska"}


@dataclass(frozen=True)
class VideoHeader:
    container: str
    codec: str
    width: int
    height: int
    duration_s: float | None
    average_fps: float | None


@dataclass(frozen=True)
class DecodedVideo:
    frames: list[Image.Image]
    timestamps_s: list[float]
    header: VideoHeader
    sampled_fps: float


def effective_sampling(policy: VideoPolicy, fps: float | None, max_frames: int | None) -> tuple[float, int]:
    """The request's fps / max_frames, capped by the server's policy."""
    return (
        min(fps, policy.fps) if fps else policy.fps,
        min(max_frames, policy.max_frames) if max_frames else policy.max_frames,
    )


def _open(data: bytes, fmt: str) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r", format=_DEMUXER[fmt])
    except KeyError as exc:
        raise InvalidMedia(f"{fmt} is not a video container") from exc
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise InvalidMedia(f"video container cannot be opened: {exc}") from exc


def _header(container: av.container.InputContainer, cfg: MediaConfig) -> VideoHeader:
    policy = cfg.video
    names = set(container.format.name.split(","))
    if not names & set(policy.allowed_containers):
        raise InvalidMedia(f"video container {container.format.name!r} is not accepted")
    streams = container.streams.video
    if len(streams) != 1:
        raise InvalidMedia(f"video must have exactly one video stream, found {len(streams)}")
    stream = streams[0]
    codec = stream.codec_context.name
    if codec not in policy.allowed_codecs:
        raise InvalidMedia(f"video codec {codec!r} is not accepted; accepted: {', '.join(policy.allowed_codecs)}")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise InvalidMedia("video has no frame size")
    if width * height > cfg.max_image_pixels:
        raise MediaTooLarge(f"video frames are {width}×{height}; the pixel limit is {cfg.max_image_pixels}")
    duration = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / av.time_base
    if duration is not None and duration > policy.max_duration_s:
        raise MediaTooLarge(f"video is {duration:.1f}s long; the limit is {policy.max_duration_s:g}s")
    rate = stream.average_rate
    return VideoHeader(
        container=container.format.name,
        codec=codec,
        width=width,
        height=height,
        duration_s=duration,
        average_fps=float(rate) if rate else None,
    )


def _targets(duration: float | None, fps: float, max_frames: int) -> tuple[list[float], float]:
    """Sample timestamps and the effective sampling rate."""
    if duration is None or duration <= 0:
        return [i / fps for i in range(max_frames)], fps
    n = max(1, min(max_frames, math.floor(duration * fps) or 1))
    step = max(duration / n, 1.0 / fps)
    return [i * step for i in range(n)], 1.0 / step


def inspect_video(
    data: bytes, fmt: str, cfg: MediaConfig, fps: float | None = None, max_frames: int | None = None
) -> int:
    """Header-only checks; the pixels sampling will decode (frame size × frames to sample). Decodes no frame."""
    eff_fps, eff_max = effective_sampling(cfg.video, fps, max_frames)
    with _open(data, fmt) as container:
        header = _header(container, cfg)
    targets, _ = _targets(header.duration_s, eff_fps, eff_max)
    return header.width * header.height * len(targets)


def decode_video(
    data: bytes,
    fmt: str,
    cfg: MediaConfig,
    fps: float | None = None,
    max_frames: int | None = None,
    stop: Stop = NEVER,
) -> DecodedVideo:
    """Checked header, then sampled RGB frames (``stop`` is checked between decoded frames)."""
    policy = cfg.video
    eff_fps, eff_max = effective_sampling(policy, fps, max_frames)
    with _open(data, fmt) as container:
        header = _header(container, cfg)
        targets, sampled_fps = _targets(header.duration_s, eff_fps, eff_max)
        frames: list[Image.Image] = []
        stamps: list[float] = []
        decoded = 0
        try:
            for frame in container.decode(video=0):
                stop.check("video decoding")
                decoded += 1
                if decoded > policy.max_decoded_frames:
                    raise MediaTooLarge(f"video has more than {policy.max_decoded_frames} frames")
                t = float(frame.time) if frame.time is not None else (decoded - 1) / (header.average_fps or eff_fps)
                if t > policy.max_duration_s:
                    raise MediaTooLarge(f"video runs past {policy.max_duration_s:g}s")
                if len(frames) < len(targets) and t + 1e-6 >= targets[len(frames)]:
                    frames.append(frame.to_image().convert("RGB"))
                    stamps.append(t)
                if len(frames) == len(targets) and header.duration_s is not None:
                    break
        except av.error.FFmpegError as exc:
            raise InvalidMedia(f"video data is corrupt: {exc}") from exc
    if not frames:
        raise InvalidMedia("video has no decodable frames")
    return DecodedVideo(frames=frames, timestamps_s=stamps, header=header, sampled_fps=sampled_fps)
