"""Small networking helpers shared by the test packages."""

from __future__ import annotations

import random
import socket
import subprocess
import time

import httpx

RAY_WORKER_PORTS = range(10002, 20000)
"""Ray's default ``min_worker_port``–``max_worker_port``: its workers bind ports there."""
_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never handed out before by this process, and outside both the kernel's
    ephemeral range and Ray's worker ports. Why: the port is bound later, by a server the test starts, and a port the
    kernel chose for ``bind(0)`` could meanwhile go to any process binding port 0 — Ray's own processes bind dozens —
    which once left Ray's metrics agent without its port in CI (``Address already in use``; every scrape refused)."""
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


def _proc_net_listeners() -> dict[int, tuple[str, int]]:
    """Socket inode → (address, port) of every listening TCP socket in this network namespace (IPv4 and IPv6)."""
    import ipaddress
    import struct

    found: dict[int, tuple[str, int]] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = struct.unpack("<" + "I" * (width // 4), raw)
            packed = struct.pack(">" + "I" * (width // 4), *words)
            ip = ipaddress.ip_address(packed)
            if ip.version == 6 and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            found[int(fields[9])] = (str(ip), int(hex_port, 16))
    return found


def tcp_listeners(pids: list[int]) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every TCP socket the processes ``pids`` listen on."""
    import os

    table = _proc_net_listeners()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in table:
                    out.append((*table[inode], pid))
    return out
