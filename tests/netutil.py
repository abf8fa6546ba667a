"""Small networking helpers shared by the test packages."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Poll ``url`` until it answers 200; False if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False
