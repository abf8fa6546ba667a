"""Video header check and frame sampling with PyAV.

The demuxer is forced from the sniffed format (``mov`` for MP4/MOV, ``matroska`` for MKV/WebM) so FFmpeg never
probes its way into a playlist or concat demuxer that could open other files or URLs. Then, before any frame is
decoded: exactly one video stream, an allowed codec, frame size within ``max_image_pixels`` and duration within the
server's ``max_duration_s``. Sampling takes frames at the effective fps (evenly spread over the clip when that
would exceed the effective ``max_frames``); a request may lower the server's fps / max_frames, never raise them. The
frames to sample are chosen from the header before any is decoded (and their pixels charged to the media stage's
budget then: :func:`inspect_video`); decoding then goes from one to the next, **seeking** to the keyframe before a
target that lies more than ``SEEK_AHEAD_S`` past the last decoded frame instead of decoding every frame in between —
two frames of a long clip cost two keyframe intervals, not half the clip. Each target gets the first frame at or after
its time, whether reached by seeking or by decoding on (the same frame either way). Decoding stops at
``max_decoded_frames`` or when frames run past the allowed duration (a lying header).
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

SEEK_AHEAD_S = 1.0
"""A target this far past the last decoded frame is reached by seeking (to the keyframe at or before it)."""


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
    decoded_frames: int = 0
    """Frames the decoder produced to get them (seeking skips the rest)."""


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
    eff_fps, eff_max = effective_sampling(cfg.video, fps, max_frames)
    with _open(data, fmt) as container:
        header = _header(container, cfg)
        targets, sampled_fps = _targets(header.duration_s, eff_fps, eff_max)
        sampler = _Sampler(container, header, targets, cfg.video, eff_fps, stop)
        try:
            sampler.run()
        except av.error.FFmpegError as exc:
            raise InvalidMedia(f"video data is corrupt: {exc}") from exc
    if not sampler.frames:
        raise InvalidMedia("video has no decodable frames")
    return DecodedVideo(sampler.frames, sampler.stamps, header, sampled_fps, sampler.decoded)


class _Sampler:
    """Decodes a container's video stream from target to target (see the module docstring)."""

    def __init__(
        self,
        container: av.container.InputContainer,
        header: VideoHeader,
        targets: list[float],
        policy: VideoPolicy,
        fps: float,
        stop: Stop,
    ) -> None:
        self.container, self.header, self.targets, self.policy, self.stop = container, header, targets, policy, stop
        self.stream = container.streams.video[0]
        self.fallback_fps = header.average_fps or fps
        self.frames: list[Image.Image] = []
        self.stamps: list[float] = []
        self.decoded = 0
        self.last = -math.inf  # time of the last decoded frame

    def run(self) -> None:
        seekable = self.header.duration_s is not None and self.stream.time_base is not None
        while len(self.frames) < len(self.targets):
            target = self.targets[len(self.frames)]
            if seekable and target - self.last > SEEK_AHEAD_S and self.frames:
                self.container.seek(int(target / self.stream.time_base), stream=self.stream, backward=True)
            if not self._decode_to(target):
                return  # the clip ended before the target

    def _decode_to(self, target: float) -> bool:
        """Decode on until a frame at or after ``target`` (taken); False when the stream ends first."""
        for frame in self.container.decode(self.stream):
            self.stop.check("video decoding")
            self.decoded += 1
            if self.decoded > self.policy.max_decoded_frames:
                raise MediaTooLarge(f"video has more than {self.policy.max_decoded_frames} frames")
            t = float(frame.time) if frame.time is not None else (self.decoded - 1) / self.fallback_fps
            if t > self.policy.max_duration_s:
                raise MediaTooLarge(f"video runs past {self.policy.max_duration_s:g}s")
            self.last = t
            if t + 1e-6 >= target and (not self.stamps or t > self.stamps[-1]):
                self.frames.append(frame.to_image().convert("RGB"))
                self.stamps.append(t)
                return True
        return False
