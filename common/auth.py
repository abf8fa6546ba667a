"""API key → tenant: the key store each ingress replica authenticates requests with, from their headers, before any
body byte is read (HTTP ``Authorization: Bearer``, gRPC ``api_key``).

Lifecycle. Built once per ingress replica from :class:`~common.config.ServerConfig`: the inline ``api_keys`` plus
the keys in ``api_keys_file`` (a mounted Kubernetes Secret in the Helm chart). Every key is hashed (SHA-256) as it is
loaded and only the digests are kept, so a heap dump or a stray repr shows no key. A lookup hashes the presented key
and compares its digest with *every* stored digest through :func:`hmac.compare_digest`, without stopping at the
match: neither which key matched nor how much of a digest agreed shows in the time taken.

Rotation. With ``api_keys_file`` set, a lookup ``stat``\\ s the file at most every ``api_keys_reload_s``; when its
identity (inode, size, mtime — Kubernetes swaps a Secret's files through a symlink, so each update is a new inode)
changed, it is re-read and its keys replace the file's previous ones — a new key works and a removed key stops
working without a restart. A file that cannot be read or parsed mid-rotation keeps the last good keys and logs why:
a broken update neither opens the door nor locks every tenant out.

Fail closed. Authentication is on whenever a key source is configured: a configured file that holds no key refuses
every request (401), it never means "anonymous". Only a config with neither ``api_keys`` nor ``api_keys_file`` serves
everyone as tenant ``default`` (the local configs).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable

from common.config import ServerConfig, read_keys_file
from common.errors import AuthenticationError

log = logging.getLogger("prism.auth")

ANONYMOUS_TENANT = "default"


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value (scheme case-insensitive, key stripped); ``None`` for an
    absent value or another scheme. The one parse of it: the HTTP and gRPC guards and the ingress read it alike."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return None
    return authorization[7:].strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _hashed(keys: dict[str, str]) -> list[tuple[bytes, str]]:
    return [(_digest(k), tenant) for k, tenant in keys.items()]


def key_digests(keys: dict[str, str]) -> dict[str, str]:
    """API key → tenant as SHA-256 hex digest → tenant: what a process that must check keys but need not hold them
    (Serve's proxies, :mod:`services.platform.proxy_guard`) is given."""
    return {_digest(k).hex(): tenant for k, tenant in keys.items()}


class KeyStore:
    def __init__(
        self, server: ServerConfig, clock: Callable[[], float] = time.monotonic, digests: dict[str, str] | None = None
    ) -> None:
        """``server``'s inline keys and key file; ``digests``: more keys, as :func:`key_digests` gives them."""
        self._path = server.api_keys_file
        self._interval = server.api_keys_reload_s
        self._clock = clock
        self._inline = _hashed(server.api_keys) + [(bytes.fromhex(d), t) for d, t in (digests or {}).items()]
        self._lock = threading.Lock()  # lookups run on the event loop and in gRPC threads
        self.enabled = bool(self._inline) or self._path is not None
        self._seen: tuple[int, int, int] | None = None
        self._checked = clock()
        self._entries = self._inline
        if self._path is not None:  # a missing or malformed file at start is a deployment error: no replica
            self._seen = self._identity()
            self._entries = self._inline + _hashed(read_keys_file(self._path))
            if not self._entries:
                log.warning("%s holds no API key: every request is refused until one is added", self._path)

    def tenant(self, api_key: str | None) -> str:
        """The tenant ``api_key`` belongs to; :class:`AuthenticationError` (401) when it is missing or unknown."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        self._maybe_reload()
        presented = _digest(api_key or "")
        found = None
        for digest, tenant in self._entries:  # every entry, no early exit
            if hmac.compare_digest(presented, digest):
                found = tenant
        if not api_key or found is None:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>)")
        return found

    def __repr__(self) -> str:
        return f"KeyStore(keys={len(self._entries)}, file={self._path!r})"

    # ---- rotation -----------------------------------------------------------------------------------------
    def _identity(self) -> tuple[int, int, int]:
        st = os.stat(self._path)  # follows the Secret's ..data symlink
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        now = self._clock()
        if now - self._checked < self._interval:
            return
        with self._lock:
            if now - self._checked < self._interval:
                return
            self._checked = now
            try:
                seen = self._identity()
                if seen == self._seen:
                    return
                keys = read_keys_file(self._path)
            except (OSError, ValueError) as exc:  # mid-swap or a bad update: keep serving the last good keys
                log.error("API keys file %s not reloaded, keeping the previous keys: %s", self._path, exc)
                return
            self._seen = seen
            self._entries = self._inline + _hashed(keys)  # swapped whole: lookups never see half a reload
            log.info("API keys reloaded from %s: %d keys", self._path, len(self._entries))
