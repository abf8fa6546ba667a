"""Decoding: orientation, colour modes and transparency end as the RGB image the model should see; video sampling
follows the server policy, which a request may lower but never raise."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from common.config.media import MediaConfig, VideoPolicy
from common.media.fetch import MediaFetcher
from common.media.loader import load_media
from common.media.sniff import sniff
from common.media.video import decode_video, effective_sampling
from common.protocol.handoff import MediaRef
from tests.mediakit import exif_rotated_jpeg, gif_bytes, jpeg_bytes, png_bytes, video_bytes


def _decode(data: bytes, mime: str = "image/png", cfg: MediaConfig | None = None):
    cfg = cfg or MediaConfig()
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return load_media([MediaRef("image", url)], cfg, MediaFetcher(cfg))[0].image


def test_exif_orientation_is_applied():
    img = _decode(exif_rotated_jpeg(), "image/jpeg")
    assert img.size == (20, 40), "orientation 6 turns the stored 40×20 image into 20×40"
    top, bottom = np.asarray(img)[2, 10], np.asarray(img)[37, 10]
    assert top[0] > 200 and top[2] < 60, "the stored left (red) half is on top after rotating 90° clockwise"
    assert bottom[2] > 200 and bottom[0] < 60


def test_cmyk_jpeg_becomes_rgb():
    cmyk = Image.new("CMYK", (16, 8), (0, 255, 255, 0))  # pure red in CMYK
    img = _decode(jpeg_bytes(cmyk), "image/jpeg")
    assert img.mode == "RGB"
    r, g, b = np.asarray(img).reshape(-1, 3).mean(axis=0)
    assert r > 200 and g < 60 and b < 60


def test_16bit_png_is_scaled_not_clipped():
    arr = np.linspace(0, 65535, 32 * 8, dtype=np.uint16).reshape(8, 32)
    img = _decode(png_bytes(Image.fromarray(arr)))  # uint16 → mode I;16
    assert img.mode == "RGB"
    out = np.asarray(img)[..., 0].astype(int)
    assert out.min() <= 1 and out.max() >= 254, "full 16-bit range maps onto full 8-bit range"
    assert len(np.unique(out)) > 100, "values keep their gradient instead of clipping at 255"


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparency_composited_on_background(mode):
    src = Image.new(mode, (10, 10), (0, 0) if mode == "LA" else (0, 0, 0, 0))
    white = _decode(png_bytes(src), cfg=MediaConfig(background_rgb=(255, 255, 255)))
    grey = _decode(png_bytes(src), cfg=MediaConfig(background_rgb=(128, 128, 128)))
    assert white.getpixel((5, 5)) == (255, 255, 255)
    assert grey.getpixel((5, 5)) == (128, 128, 128)


def test_palette_with_transparency_and_grey_images():
    p = Image.new("P", (6, 6), 0)
    p.putpalette([10, 20, 30] * 256)
    buf = io.BytesIO()
    p.save(buf, "PNG", transparency=0)
    assert _decode(buf.getvalue()).getpixel((1, 1)) == (255, 255, 255)
    assert _decode(png_bytes(Image.new("L", (4, 4), 77))).getpixel((0, 0)) == (77, 77, 77)
    assert _decode(png_bytes(Image.new("1", (4, 4), 1))).getpixel((0, 0)) == (255, 255, 255)


def test_animated_gif_gives_first_frame_and_other_formats_decode():
    assert _decode(gif_bytes(5), "image/gif").size == (1, 1)
    for fmt, mime in (("WEBP", "image/webp"), ("BMP", "image/bmp")):
        buf = io.BytesIO()
        Image.new("RGB", (12, 7), (1, 2, 3)).save(buf, fmt)
        assert sniff(buf.getvalue()) == ("image", fmt)
        assert _decode(buf.getvalue(), mime).size == (12, 7)


# ---- video ------------------------------------------------------------------------------------------------------


def test_request_may_lower_but_not_raise_caps():
    policy = VideoPolicy(fps=2.0, max_frames=8)
    assert effective_sampling(policy, None, None) == (2.0, 8)
    assert effective_sampling(policy, 1.0, 4) == (1.0, 4)
    assert effective_sampling(policy, 30.0, 1000) == (2.0, 8)


@pytest.mark.parametrize("fmt,mime", [("mp4", "video/mp4"), ("webm", "video/webm")])
def test_video_frames_sampled_by_policy(fmt, mime):
    data = video_bytes(4.0, fps=10, fmt=fmt)
    kind, sniffed = sniff(data)
    assert kind == "video"
    cfg = MediaConfig(video=VideoPolicy(fps=2.0, max_frames=32))
    video = decode_video(data, sniffed, cfg)
    assert len(video.frames) == 8 and video.sampled_fps == pytest.approx(2.0)
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in video.frames)
    gaps = np.diff(video.timestamps_s)
    assert np.allclose(gaps, 0.5, atol=0.11)
    assert not np.array_equal(np.asarray(video.frames[0]), np.asarray(video.frames[1]))

    few = decode_video(data, sniffed, cfg, max_frames=3)  # lowered by the request: spread over the clip
    assert len(few.frames) == 3 and few.timestamps_s[-1] > 2.0
    capped = decode_video(data, sniffed, MediaConfig(video=VideoPolicy(fps=2.0, max_frames=4)), fps=10, max_frames=99)
    assert len(capped.frames) == 4


def test_video_through_the_media_loader():
    data = video_bytes(2.0, fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    cfg = MediaConfig()
    out = load_media([MediaRef("video", url, fps=1.0)], cfg, MediaFetcher(cfg))[0]
    assert out.kind == "video" and len(out.frames) == 2 and out.format == "MP4"


def _clip(seconds: float, fps: int, gop: int) -> bytes:
    """An H.264 clip with a keyframe every ``gop`` frames and a bar that moves every frame."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps, options={"g": str(gop), "keyint_min": str(gop)})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(int(seconds * fps)):
            arr = np.full((48, 64, 3), 40, np.uint8)
            arr[:, (i * 2) % 60 : (i * 2) % 60 + 4] = 250
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_sparse_frames_are_reached_by_seeking_and_equal_the_sequential_decode(monkeypatch):
    """Two frames of a 20 s clip (keyframe every second) cost a few decoded frames, not the first half of the clip;
    they are the frames a sequential decode takes for the same targets."""
    import common.media.video as video

    data = _clip(20.0, fps=10, gop=10)
    cfg = MediaConfig(video=VideoPolicy(fps=2.0, max_frames=32))
    sparse = decode_video(data, "MP4", cfg, max_frames=2)
    every_2s = decode_video(data, "MP4", cfg, fps=0.5, max_frames=10)
    assert sparse.timestamps_s == pytest.approx([0.0, 10.0]) and sparse.decoded_frames <= 12
    assert len(every_2s.frames) == 10 and every_2s.decoded_frames <= 10 * 11
    monkeypatch.setattr(video, "SEEK_AHEAD_S", float("inf"))  # never seek: decode every frame on the way
    for seeking, request in ((sparse, {"max_frames": 2}), (every_2s, {"fps": 0.5, "max_frames": 10})):
        sequential = decode_video(data, "MP4", cfg, **request)
        assert sequential.timestamps_s == seeking.timestamps_s
        assert sequential.decoded_frames > seeking.decoded_frames
        for a, b in zip(seeking.frames, sequential.frames, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
