"""SSRF-safe media fetcher: ``http(s)``, ``data:`` and (under a root) ``file://`` — one implementation for online
serving and offline batches.

Lifecycle of one HTTP fetch, every hop re-checked:

1. Parse the URL once with ``httpx.URL`` — the same parser that builds the request — and refuse userinfo, schemes
   not allowed, and a downgrade from https to http on redirect.
2. Check the host against the domain allow/deny lists; resolve it **once**; every A/AAAA answer must pass
   :func:`common.media.netguard.address_allowed` (one bad answer blocks the fetch: no "pick a good one" games).
3. Connect to the checked IP literal, keeping the name in the ``Host`` header and TLS SNI/certificate check — so a
   second DNS answer (rebinding) can never be used. Proxy variables are ignored (``trust_env=False``); no connection
   pooling, so a TLS session for one name is never reused for another on the same IP.
4. Redirects (≤ ``max_redirects``) are followed by hand and go back to step 1.
5. ``Content-Length`` over the cap is refused before reading; the body is streamed, counted and hashed, and the
   fetch aborts as soon as the cap, a per-read timeout or the total deadline is hit.

Everything that goes wrong raises a typed :mod:`common.errors` error with a distinct code.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

import httpx

from common.config.media import RASTER_MIME, VIDEO_MIME, MediaConfig
from common.errors import (
    InvalidMedia,
    InvalidMediaURL,
    MediaFetchBlocked,
    MediaFetchFailed,
    MediaFetchTimeout,
    MediaFetchUnavailable,
    MediaTooLarge,
)
from common.media.netguard import address_allowed, parse_networks
from common.stop import NEVER, Stop

Resolver = Callable[[str, int], list[str]]
"""(host, port) → IP address strings. Injected in tests; :func:`system_resolver` otherwise."""

_ACCEPTED_CONTENT_TYPES = (*RASTER_MIME, *VIDEO_MIME, "application/octet-stream", "binary/octet-stream")


@dataclass(frozen=True)
class FetchedMedia:
    """Raw bytes of one media item, their digest, and what the source claimed they are."""

    data: bytes
    digest: str
    declared_mime: str | None
    source: Literal["http", "data", "file"]


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MediaFetchUnavailable(f"cannot resolve the media host: {exc.strerror}") from exc
    return list(dict.fromkeys(info[4][0] for info in infos))


class TimedResolver:
    """:func:`system_resolver` with a timeout. ``getaddrinfo`` cannot be interrupted, so lookups run on a pool of
    ``workers`` threads of their own and the caller stops waiting after ``timeout_s`` (a lookup that hangs keeps its
    thread until the system gives up; at most ``workers`` do, and a lookup queued behind them times out all the
    same)."""

    def __init__(self, timeout_s: float, workers: int = 4, resolve: Resolver = system_resolver) -> None:
        self.timeout_s, self._resolve = timeout_s, resolve
        self._pool = ThreadPoolExecutor(workers, "prism-dns")

    def __call__(self, host: str, port: int) -> list[str]:
        future = self._pool.submit(self._resolve, host, port)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()  # (still queued: never runs)
            raise MediaFetchTimeout(f"the media host's name did not resolve within {self.timeout_s:g}s") from None


def _mime(value: str | None) -> str | None:
    return value.split(";", 1)[0].strip().lower() if value else None


class MediaFetcher:
    """Fetches media under a :class:`MediaConfig` policy. Thread-safe; holds no connections between fetches."""

    def __init__(
        self, cfg: MediaConfig, resolver: Resolver = system_resolver, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.cfg = cfg
        self._resolver = resolver
        self._transport = transport
        self._private = parse_networks(cfg.allowed_private_networks)

    # ---- entry point ----------------------------------------------------------------------------------------
    def fetch(self, url: str, max_bytes: int | None = None, stop: Stop = NEVER) -> FetchedMedia:
        """Fetch ``url`` with at most ``max_bytes`` (default: the per-item cap), within ``total_timeout_s`` and the
        request's ``stop`` (its deadline, its caller going away)."""
        cap = min(max_bytes or self.cfg.max_item_bytes, self.cfg.max_item_bytes)
        scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
        if scheme not in self.cfg.allowed_schemes or (scheme == "file" and not self.cfg.file_root):
            raise MediaFetchBlocked(f"URL scheme {scheme or '(none)'!r} is not allowed", param="url")
        if scheme == "data":
            return self._fetch_data(url, cap)
        if scheme == "file":
            return self._fetch_file(url, cap)
        if scheme not in ("http", "https"):
            raise MediaFetchBlocked(f"URL scheme {scheme!r} is not supported for media", param="url")
        return self._fetch_http(url, cap, stop)

    # ---- data: ----------------------------------------------------------------------------------------------
    def _fetch_data(self, url: str, cap: int) -> FetchedMedia:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise InvalidMediaURL("data URL has no ',' separator", param="url")
        parts = [p.strip().lower() for p in header.split(";")]
        mime = parts[0] or None
        if "base64" not in parts[1:]:
            raise InvalidMedia("data URLs must be base64-encoded (';base64,')", param="url")
        if mime not in (*RASTER_MIME, *VIDEO_MIME):
            raise InvalidMedia(f"data URL media type {mime!r} is not an accepted image or video type", param="url")
        limit = 4 * (-(-cap // 3))
        if len(payload) > limit:  # before decoding: never materialise an oversized payload
            raise MediaTooLarge(f"data URL payload is {len(payload)} characters; the limit is {limit}", param="url")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidMedia(f"data URL is not valid base64: {exc}", param="url") from exc
        if len(data) > cap:
            raise MediaTooLarge(f"media is {len(data)} bytes; the limit is {cap}", param="url")
        return FetchedMedia(data=data, digest=hashlib.sha256(data).hexdigest(), declared_mime=mime, source="data")

    # ---- file:// --------------------------------------------------------------------------------------------
    def _fetch_file(self, url: str, cap: int) -> FetchedMedia:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaFetchBlocked("file:// URLs must not name a host", param="url")
        root = os.path.realpath(self.cfg.file_root or "")
        path = os.path.realpath(unquote(parts.path))
        if os.path.commonpath([root, path]) != root:
            raise MediaFetchBlocked("file:// path is outside the allowed media root", param="url")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise MediaFetchFailed(f"cannot open media file: {exc.strerror}", param="url") from exc
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise MediaTooLarge(f"media file is {size} bytes; the limit is {cap}", param="url")
            data = f.read(cap + 1)
        if len(data) > cap:
            raise MediaTooLarge(f"media file is over {cap} bytes", param="url")
        return FetchedMedia(data=data, digest=hashlib.sha256(data).hexdigest(), declared_mime=None, source="file")

    # ---- http(s) --------------------------------------------------------------------------------------------
    def _check_host(self, url: httpx.URL) -> str:
        """Domain lists + resolve once + every answer allowed → the IP to connect to."""
        if url.userinfo:
            raise MediaFetchBlocked("media URLs must not carry credentials (user:password@)", param="url")
        host = url.host.lower().rstrip(".")
        if not host:
            raise InvalidMediaURL("media URL has no host", param="url")

        def matches(domains: tuple[str, ...]) -> bool:
            return any(host == d or host.endswith("." + d) for d in domains)

        if matches(self.cfg.denied_domains):
            raise MediaFetchBlocked("media host is on the deny list", param="url")
        if self.cfg.allowed_domains and not matches(self.cfg.allowed_domains):
            raise MediaFetchBlocked("media host is not on the allow list", param="url")
        port = url.port or (443 if url.scheme == "https" else 80)
        if host == "localhost" or host.endswith(".localhost"):
            # RFC 6761: these names are loopback whatever DNS says (and "localhost." may not be in /etc/hosts).
            answers = ["127.0.0.1", "::1"]
        else:
            answers = self._resolver(url.host, port)
        if not answers:
            raise MediaFetchUnavailable("media host resolved to no address")
        for answer in answers:
            try:
                addr = ipaddress.ip_address(answer.split("%", 1)[0])
            except ValueError as exc:
                raise MediaFetchBlocked(f"resolver returned a non-IP answer {answer!r}") from exc
            if not address_allowed(addr, self._private):
                raise MediaFetchBlocked("media host resolves to a non-public address", param="url")
        return answers[0].split("%", 1)[0]

    def _fetch_http(self, url_text: str, cap: int, stop: Stop = NEVER) -> FetchedMedia:
        try:
            url = httpx.URL(url_text)
        except (httpx.InvalidURL, ValueError) as exc:
            raise InvalidMediaURL(f"media URL cannot be parsed: {exc}", param="url") from exc
        deadline = time.monotonic() + self.cfg.total_timeout_s
        if stop.deadline is not None:
            deadline = min(deadline, stop.deadline)  # never past the request's own deadline
        client = httpx.Client(
            transport=self._transport,
            trust_env=False,
            follow_redirects=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        with client:
            for _hop in range(self.cfg.max_redirects + 1):
                stop.check("the media fetch")
                ip = self._check_host(url)
                response = self._send(client, url, ip, deadline)
                try:
                    if response.is_redirect:
                        url = self._next_hop(url, response.headers.get("location", ""))
                        continue
                    return self._read_body(response, cap, deadline, stop)
                finally:
                    response.close()
        raise MediaFetchFailed(f"media URL redirected more than {self.cfg.max_redirects} times", param="url")

    def _next_hop(self, current: httpx.URL, location: str) -> httpx.URL:
        try:
            nxt = current.join(location)
        except (httpx.InvalidURL, ValueError) as exc:
            raise MediaFetchFailed(f"media redirect has an invalid Location: {exc}", param="url") from exc
        if nxt.scheme not in ("http", "https") or nxt.scheme not in self.cfg.allowed_schemes:
            raise MediaFetchBlocked(f"media redirect to scheme {nxt.scheme!r} is not allowed", param="url")
        if current.scheme == "https" and nxt.scheme != "https":
            raise MediaFetchBlocked("media redirect from https to http is not allowed", param="url")
        return nxt

    def _send(self, client: httpx.Client, url: httpx.URL, ip: str, deadline: float) -> httpx.Response:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MediaFetchTimeout(f"media fetch exceeded {self.cfg.total_timeout_s}s")
        host_header = url.netloc.decode("ascii")  # name[:port], IPv6 bracketed
        timeout = httpx.Timeout(
            connect=min(self.cfg.connect_timeout_s, remaining),
            read=min(self.cfg.read_timeout_s, remaining),
            write=min(self.cfg.read_timeout_s, remaining),
            pool=min(self.cfg.connect_timeout_s, remaining),
        )
        request = client.build_request(
            "GET",
            url.copy_with(host=ip),
            # identity encoding: a gzip body could inflate past the byte cap after we counted it
            headers={
                "Host": host_header,
                "Accept": "image/*, video/*",
                "Accept-Encoding": "identity",
                "User-Agent": "prism-media-fetcher/1",
            },
            extensions={"sni_hostname": url.host},
            timeout=timeout,
        )
        try:
            return client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise MediaFetchTimeout("media host did not answer in time") from exc
        except httpx.HTTPError as exc:
            raise MediaFetchUnavailable(f"cannot reach the media host: {type(exc).__name__}") from exc

    def _read_body(self, response: httpx.Response, cap: int, deadline: float, stop: Stop = NEVER) -> FetchedMedia:
        status = response.status_code
        if status >= 500 or status == 429:
            raise MediaFetchUnavailable(f"media host answered HTTP {status}", param="url")
        if status >= 400 or status < 200 or status == 204:
            raise MediaFetchFailed(f"media host answered HTTP {status}", param="url")
        mime = _mime(response.headers.get("content-type"))
        if mime is not None and mime not in _ACCEPTED_CONTENT_TYPES:
            raise InvalidMedia(f"media host sent content type {mime!r}, not an image or video", param="url")
        declared = response.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise MediaTooLarge(f"media is {int(declared)} bytes (Content-Length); the limit is {cap}", param="url")
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        size = 0
        try:
            for chunk in response.iter_raw():  # each network read as it comes: every check runs per read
                size += len(chunk)
                if size > cap:
                    raise MediaTooLarge(f"media is over {cap} bytes; download stopped at the limit", param="url")
                if time.monotonic() > deadline:
                    stop.check("the media download")  # the request's deadline, if that is the one that passed
                    raise MediaFetchTimeout(f"media fetch exceeded {self.cfg.total_timeout_s}s")
                stop.check("the media download")
                digest.update(chunk)
                chunks.append(chunk)
        except httpx.TimeoutException as exc:
            raise MediaFetchTimeout("media host stopped sending in time") from exc
        except httpx.HTTPError as exc:
            raise MediaFetchUnavailable(f"media download failed: {type(exc).__name__}") from exc
        return FetchedMedia(data=b"".join(chunks), digest=digest.hexdigest(), declared_mime=mime, source="http")
