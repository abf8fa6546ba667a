"""Format detection by magic bytes, and frame counting without decoding.

The format is decided by the bytes, never by a URL suffix or a declared MIME type (an SVG served as
``image/png`` is still not a PNG). Only raster formats Pillow decodes safely are images; MP4/MOV and Matroska/WebM
are videos. Frame counters walk container structure (GIF blocks, WebP ``ANMF`` chunks, APNG ``acTL``) and stop one
past the limit, so a 10,000-frame GIF is refused after reading its block headers, not after decoding frames.
"""

from __future__ import annotations

import struct
from typing import Literal

from common.errors import InvalidMedia

ImageFormat = Literal["JPEG", "PNG", "GIF", "WEBP", "BMP"]
VideoFormat = Literal["MP4", "MATROSKA"]


def sniff(data: bytes) -> tuple[Literal["image", "video"], str]:
    """(modality, format) of ``data``; :class:`InvalidMedia` for anything unsupported."""
    if not data:
        raise InvalidMedia("media is empty")
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "WEBP"
    if head[:2] == b"BM" and len(data) >= 26:
        return "image", "BMP"
    if head[4:8] == b"ftyp":
        return "video", "MP4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "video", "MATROSKA"
    text = data[:256].lstrip().lower()
    if text.startswith((b"<svg", b"<?xml", b"<!doctype", b"<html")):
        raise InvalidMedia("vector/markup formats (SVG, HTML, XML) are not accepted; send a raster image")
    raise InvalidMedia("media format not recognised; accepted: JPEG, PNG, WebP, GIF, BMP, MP4/MOV, WebM/MKV")


def count_frames(data: bytes, fmt: str, limit: int) -> int:
    """Frames in an image file, counted from structure; stops at ``limit + 1``."""
    if fmt == "GIF":
        return _gif_frames(data, limit)
    if fmt == "WEBP":
        return _webp_frames(data, limit)
    if fmt == "PNG":
        return _apng_frames(data)
    return 1


def _gif_frames(data: bytes, limit: int) -> int:
    try:
        pos = 13
        flags = data[10]
        if flags & 0x80:  # global colour table
            pos += 3 * (2 ** ((flags & 0x07) + 1))
        frames = 0
        while pos < len(data) and frames <= limit:
            block = data[pos]
            if block == 0x3B:  # trailer
                break
            if block == 0x2C:  # image descriptor
                frames += 1
                local = data[pos + 9]
                pos += 10
                if local & 0x80:
                    pos += 3 * (2 ** ((local & 0x07) + 1))
                pos += 1  # LZW minimum code size
            elif block == 0x21:  # extension: label then sub-blocks
                pos += 2
            else:
                raise InvalidMedia("GIF structure is corrupt")
            while pos < len(data) and data[pos] != 0:  # skip data sub-blocks
                pos += data[pos] + 1
            pos += 1
        return max(frames, 1)
    except IndexError as exc:
        raise InvalidMedia("GIF is truncated") from exc


def _webp_frames(data: bytes, limit: int) -> int:
    pos, frames = 12, 0
    while pos + 8 <= len(data) and frames <= limit:
        tag = data[pos : pos + 4]
        (size,) = struct.unpack("<I", data[pos + 4 : pos + 8])
        if tag == b"ANMF":
            frames += 1
        pos += 8 + size + (size & 1)
    return max(frames, 1)


def _apng_frames(data: bytes) -> int:
    pos = 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag = data[pos + 4 : pos + 8]
        if tag == b"acTL" and pos + 12 <= len(data):
            return max(1, struct.unpack(">I", data[pos + 8 : pos + 12])[0])
        if tag in (b"IDAT", b"IEND"):  # acTL must come before the image data
            break
        pos += 12 + length
    return 1
