"""The ports the bench, ``make chaos`` and the tests hand to the servers they start: free now, each once, and outside
the ranges where another process is given one by chance (Ray's worker ports, the kernel's ephemeral range)."""

from __future__ import annotations

import socket

from loadtest import bench_servers
from loadtest.ports import RAY_WORKER_PORTS, _ephemeral_start, free_port


def test_ports_are_free_distinct_and_outside_the_ranges_given_by_chance():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port not in RAY_WORKER_PORTS and port < _ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # (free: raises otherwise)


def test_the_bench_picks_its_ports_the_same_way():
    assert bench_servers.free_port is free_port
