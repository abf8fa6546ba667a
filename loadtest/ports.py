"""Ports for the servers a bench, ``make chaos`` or a test starts on this machine.

The port is chosen now and bound later, by a server that starts in the meantime with Ray's processes around it. A port
the kernel chose for ``bind(0)`` could go to any process binding port 0 before then — Ray's own bind dozens — which
once left Ray's metrics agent without its port in CI (``Address already in use``; every scrape refused) and, in a
bench's run, HAProxy without the front door's (the application never started). So a port comes from between Ray's
worker ports and the kernel's ephemeral range, where nobody is handed one by chance.
"""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS = range(10002, 20000)
"""Ray's default ``min_worker_port``–``max_worker_port``: its workers bind ports there."""
_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never handed out before by this process, and outside both the kernel's
    ephemeral range and Ray's worker ports (see the module docstring)."""
    low, high = RAY_WORKER_PORTS.stop, _ephemeral_start() - 1
    for _ in range(500 if high - low > 1000 else 0):
        port = random.randint(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # (no room below the ephemeral range: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
