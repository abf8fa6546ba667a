"""Hostile and broken media: each case gets its specific error code, and nothing is read or decoded past the limit."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import pytest
from PIL import Image

from common.config.media import MediaConfig, VideoPolicy
from common.errors import PrismError
from common.media import image as image_mod
from common.media.fetch import MediaFetcher
from common.media.image import check_pillow_guard
from common.media.loader import check_request, load_media
from common.protocol.handoff import MediaRef
from common.stop import Stop
from tests.mediakit import (
    MediaServer,
    Route,
    drip,
    gif_bytes,
    jpeg_bytes,
    png_bomb,
    png_bytes,
    video_bytes,
)

LOCAL = ("127.0.0.1/32",)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _code(fn, *args, **kwargs) -> PrismError:
    with pytest.raises(PrismError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    """Fails the test if any image's pixel data gets decoded."""
    calls = []

    def spying(original):
        def spy(self, *a, **k):
            calls.append(self.size)
            return original(self, *a, **k)

        return spy

    monkeypatch.setattr(Image.Image, "load", spying(Image.Image.load))
    monkeypatch.setattr(image_mod.ImageFile.ImageFile, "load", spying(image_mod.ImageFile.ImageFile.load))
    return calls


def _load(url: str, kind: str = "image", cfg: MediaConfig | None = None):
    cfg = cfg or MediaConfig(allowed_private_networks=LOCAL)
    return load_media([MediaRef(kind=kind, url=url)], cfg, MediaFetcher(cfg))


# ---- layer 1: before fetching ---------------------------------------------------------------------------------


def test_too_many_items_refused_before_any_fetch():
    with MediaServer() as server:
        server.routes["/a.png"] = Route(body=png_bytes())
        cfg = MediaConfig(allowed_private_networks=LOCAL, max_items_per_request=2)
        refs = [MediaRef("image", server.url("/a.png"))] * 3
        err = _code(load_media, refs, cfg, MediaFetcher(cfg))
        assert err.code == "too_many_media_items" and err.http_status == 400 and "limit is 2" in err.message
        assert server.seen == []


def test_huge_data_url_refused_before_base64_decoding(monkeypatch):
    decoded = []
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: decoded.append(1))
    cfg = MediaConfig(max_item_bytes=1000)
    url = "data:image/png;base64," + "A" * 2000
    err = _code(check_request, [MediaRef("image", url)], cfg)
    assert err.code == "media_too_large" and err.http_status == 413 and "1336" in err.message
    err = _code(MediaFetcher(cfg).fetch, url)
    assert err.code == "media_too_large"
    assert decoded == []


def test_bad_items_later_in_the_request_stop_earlier_fetches():
    with MediaServer() as server:
        server.routes["/a.png"] = Route(body=png_bytes())
        cfg = MediaConfig(allowed_private_networks=LOCAL)
        refs = [MediaRef("image", server.url("/a.png")), MediaRef("image", "gopher://x/")]
        assert _code(load_media, refs, cfg, MediaFetcher(cfg)).code == "media_fetch_blocked"
        assert server.seen == []


@pytest.mark.parametrize("mime", ["image/svg+xml", "text/html", "application/pdf", ""])
def test_data_url_declared_type_must_be_raster(mime):
    err = _code(check_request, [MediaRef("image", data_url(b"<svg/>", mime))], MediaConfig())
    assert err.code == "invalid_media"


def test_data_url_must_be_valid_base64():
    err = _code(MediaFetcher(MediaConfig()).fetch, "data:image/png;base64,@@@notbase64@@@")
    assert err.code == "invalid_media"
    err = _code(MediaFetcher(MediaConfig()).fetch, "data:image/png,rawbytes")
    assert err.code == "invalid_media"


def test_request_byte_budget_spans_items():
    png = png_bytes()
    cfg = MediaConfig(max_request_bytes=len(png) + 10)
    refs = [MediaRef("image", data_url(png)), MediaRef("image", data_url(png))]
    assert _code(load_media, refs, cfg, MediaFetcher(cfg)).code == "media_too_large"


# ---- HTTP body limits and failures -------------------------------------------------------------------------


def test_content_length_over_cap_is_refused_before_reading():
    with MediaServer() as server:
        server.routes["/big"] = Route(body=b"\x89PNG" + b"\0" * 50_000, headers={"Content-Type": "image/png"})
        cfg = MediaConfig(allowed_private_networks=LOCAL, max_item_bytes=10_000)
        err = _code(MediaFetcher(cfg).fetch, server.url("/big"))
        assert err.code == "media_too_large" and "Content-Length" in err.message


def test_streamed_body_is_cut_at_the_cap():
    sent = []

    def endless():
        for _ in range(10_000):
            sent.append(1)
            yield b"\0" * 16_384

    with MediaServer() as server:
        server.routes["/stream"] = Route(body=endless, headers={"Content-Type": "image/png"})
        cfg = MediaConfig(allowed_private_networks=LOCAL, max_item_bytes=100_000)
        err = _code(MediaFetcher(cfg).fetch, server.url("/stream"))
        assert err.code == "media_too_large" and "stopped at the limit" in err.message
    assert len(sent) < 1_000, "the client must stop reading at the cap, not drain the body"


def test_slow_reads_and_total_deadline_time_out():
    with MediaServer() as server:
        server.routes["/stall"] = Route(body=drip(b"x", 2, 1.5), headers={"Content-Type": "image/png"})
        server.routes["/drip"] = Route(body=drip(b"x" * 10, 100, 0.05), headers={"Content-Type": "image/png"})
        cfg = MediaConfig(allowed_private_networks=LOCAL, read_timeout_s=0.3, total_timeout_s=0.6)
        err = _code(MediaFetcher(cfg).fetch, server.url("/stall"))
        assert err.code == "media_fetch_timeout" and err.http_status == 504
        err = _code(MediaFetcher(cfg).fetch, server.url("/drip"))
        assert err.code == "media_fetch_timeout"


def test_remote_errors_are_distinguished():
    with MediaServer() as server:
        server.routes["/boom"] = Route(status=500, body=b"oops")
        server.routes["/html"] = Route(body=b"<html></html>", headers={"Content-Type": "text/html"})
        fetcher = MediaFetcher(MediaConfig(allowed_private_networks=LOCAL))
        err = _code(fetcher.fetch, server.url("/missing.png"))
        assert (err.code, err.http_status) == ("media_fetch_failed", 422)
        err = _code(fetcher.fetch, server.url("/boom"))
        assert (err.code, err.http_status) == ("media_fetch_unavailable", 502)
        assert _code(fetcher.fetch, server.url("/html")).code == "invalid_media"
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = _code(fetcher.fetch, f"http://127.0.0.1:{port}/x.png")
    assert (err.code, err.http_status) == ("media_fetch_unavailable", 502)


# ---- files: format, header limits, corruption -----------------------------------------------------------------


def test_png_bomb_refused_from_header(no_pixel_decoding):
    cfg = MediaConfig(max_image_pixels=40_000_000)
    for w, h in ((8000, 8000), (100_000, 100_000)):  # under and over Pillow's own guard
        err = _code(_load, data_url(png_bomb(w, h)), cfg=cfg)
        assert err.code == "media_too_large" and err.http_status == 413
    assert no_pixel_decoding == []


def test_gif_bombs_refused(no_pixel_decoding):
    err = _code(_load, data_url(gif_bytes(1, 60_000, 60_000), "image/gif"))
    assert err.code == "media_too_large"
    err = _code(_load, data_url(gif_bytes(10_000), "image/gif"))
    assert err.code == "media_too_large" and "512 frames" in err.message
    assert no_pixel_decoding == []


@pytest.mark.parametrize(
    "name,data,mime",
    [
        ("truncated_jpeg", jpeg_bytes()[:300], "image/jpeg"),
        ("truncated_png", png_bytes()[:200], "image/png"),
        ("garbage", bytes(range(256)) * 4, "image/png"),
        ("empty", b"", "image/png"),
        ("svg_as_png", b'<svg xmlns="http://www.w3.org/2000/svg" width="9000" height="9000"/>', "image/png"),
        ("html_as_jpeg", b"<!DOCTYPE html><html></html>", "image/jpeg"),
    ],
)
def test_broken_or_non_raster_files_are_invalid(name, data, mime):
    err = _code(_load, data_url(data, mime)) if data else _code(_load, f"data:{mime};base64,")
    assert err.code == "invalid_media" and err.http_status == 400, name


def test_video_bytes_sent_as_image_are_refused():
    err = _code(_load, data_url(video_bytes(0.5), "image/png"))
    assert err.code == "invalid_media" and "video" in err.message


def test_corrupt_mp4_is_invalid():
    good = video_bytes(1.0)
    corrupt = good[:32] + bytes(len(good) - 32)
    for data in (corrupt, b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 200):
        err = _code(_load, data_url(data, "video/mp4"), kind="video")
        assert err.code == "invalid_media"


def test_video_longer_than_allowed_is_refused_before_decoding(monkeypatch):
    import av

    decoded = []
    original = av.container.InputContainer.decode

    def spy(self, *a, **k):
        decoded.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(av.container.InputContainer, "decode", spy)
    cfg = MediaConfig(video=VideoPolicy(max_duration_s=2.0))
    err = _code(_load, data_url(video_bytes(3.0), "video/mp4"), kind="video", cfg=cfg)
    assert err.code == "media_too_large" and "limit is 2s" in err.message
    assert decoded == []


def test_pillow_guard_is_checked(monkeypatch):
    check_pillow_guard()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(RuntimeError, match="disabled"):
        check_pillow_guard()


def test_positive_fetch_from_local_server_decodes():
    with MediaServer() as server:
        server.routes["/a.jpg"] = Route(body=jpeg_bytes(), headers={"Content-Type": "image/jpeg"})
        out = _load(server.url("/a.jpg"))
    assert out[0].kind == "image" and out[0].format == "JPEG" and out[0].image.size == (64, 48)
    assert out[0].image.mode == "RGB"
    buf = io.BytesIO()
    out[0].image.save(buf, "PNG")


def test_pixel_decoding_spy_sees_real_decodes(no_pixel_decoding):
    """Guards the guard: the spy used above must notice when pixels are decoded."""
    _load(data_url(png_bytes()))
    _load(data_url(gif_bytes(2), "image/gif"))
    assert len(no_pixel_decoding) >= 2


def test_a_download_stops_at_the_request_deadline_or_when_its_caller_leaves():
    """The media stage hands its fetches the request's Stop: the request's deadline bounds the download even when
    the media timeouts are generous, and a cancelled request's download ends at its next chunk."""
    with MediaServer() as server:
        server.routes["/drip"] = Route(body=drip(b"x" * 10, 400, 0.05), headers={"Content-Type": "image/png"})
        cfg = MediaConfig(allowed_private_networks=LOCAL, read_timeout_s=30, total_timeout_s=30)
        start = time.monotonic()
        err = _code(MediaFetcher(cfg).fetch, server.url("/drip"), stop=Stop(time.monotonic() + 0.5))
        assert err.code == "deadline_exceeded" and err.http_status == 504
        assert time.monotonic() - start < 3
        stop = Stop(time.monotonic() + 30)
        threading.Timer(0.3, stop.cancel).start()
        start = time.monotonic()
        err = _code(MediaFetcher(cfg).fetch, server.url("/drip"), stop=stop)
        assert err.code == "cancelled" and time.monotonic() - start < 3
