"""Keyed hashes that identify media in logs and traces without revealing it.

A media digest is a plain hash of the fetched bytes: anyone holding a candidate image could confirm it was sent. Logs
and traces therefore carry ``HMAC(key, digest)`` truncated to 16 hex characters, with a per-deployment secret key
(``observability.media_hash_key``): requests for the same media still correlate, but the hash proves nothing to
someone without the key.
"""

from __future__ import annotations

import hashlib
import hmac


def keyed_hash(key: str, digest: str) -> str:
    return hmac.new(key.encode(), digest.encode(), hashlib.sha256).hexdigest()[:16]
