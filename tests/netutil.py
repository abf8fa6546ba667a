"""Small networking helpers shared by the test packages."""

from __future__ import annotations

import subprocess
import time

import httpx

from loadtest.ports import free_port

__all__ = ["free_port", "tcp_listeners", "wait_for_http"]


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
