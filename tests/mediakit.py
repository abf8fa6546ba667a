"""Test helpers: a real HTTP media server on 127.0.0.1 and generators for good and hostile media files."""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

from common.media.synthetic import (
    synthetic_image,
    video_bytes,  # noqa: F401  (re-exported for the tests)
)

# ---- files ---------------------------------------------------------------------------------------------------


def png_bytes(img: Image.Image | None = None, **save) -> bytes:
    buf = io.BytesIO()
    (img or synthetic_image(64, 48)).save(buf, "PNG", **save)
    return buf.getvalue()


def jpeg_bytes(img: Image.Image | None = None, **save) -> bytes:
    buf = io.BytesIO()
    (img or synthetic_image(64, 48)).save(buf, "JPEG", **save)
    return buf.getvalue()


def _png_chunk(tag: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body) & 0xFFFFFFFF)


def png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width × height (8-bit grey); the data is a few compressed zero rows."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (width + 1) * 4, 9)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


# One 1×1 GIF frame: image descriptor, LZW min code size 2, codes clear(4) 0 end(5) packed LSB-first.
_GIF_FRAME = b"\x2c\x00\x00\x00\x00\x01\x00\x01\x00\x00" + b"\x02\x02\x44\x01\x00"


def gif_bytes(frames: int, width: int = 1, height: int = 1) -> bytes:
    """A GIF with a 2-colour global table, the given logical screen size, and ``frames`` 1×1 frames."""
    header = b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
    return header + _GIF_FRAME * frames + b"\x3b"


def exif_rotated_jpeg() -> bytes:
    """40×20 image, left half red / right half blue, stored with EXIF orientation 6 (display rotated 90° CW)."""
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = (255, 0, 0)
    arr[:, 20:] = (0, 0, 255)
    img = Image.fromarray(arr, "RGB")
    exif = img.getexif()
    exif[0x0112] = 6
    return jpeg_bytes(img, exif=exif.tobytes(), quality=95)


# ---- server --------------------------------------------------------------------------------------------------

Body = bytes | Callable[[], Iterator[bytes]]


@dataclass
class Route:
    status: int = 200
    body: Body = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_length: bool = True


@dataclass
class Seen:
    path: str
    host: str | None


class MediaServer:
    """ThreadingHTTPServer on 127.0.0.1:0 serving configured routes and recording every request."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_GET(self) -> None:
                server.seen.append(Seen(self.path, self.headers.get("Host")))
                route = server.routes.get(self.path, Route(status=404, body=b"not found"))
                self.send_response(route.status)
                for k, v in route.headers.items():
                    self.send_header(k, v)
                try:
                    if isinstance(route.body, bytes):
                        if route.content_length:
                            self.send_header("Content-Length", str(len(route.body)))
                        self.end_headers()
                        self.wfile.write(route.body)
                    else:
                        self.send_header("Connection", "close")
                        self.end_headers()
                        for chunk in route.body():
                            self.wfile.write(chunk)
                            self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> MediaServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def drip(chunk: bytes, count: int, delay: float) -> Callable[[], Iterator[bytes]]:
    def gen() -> Iterator[bytes]:
        for _ in range(count):
            yield chunk
            time.sleep(delay)

    return gen
