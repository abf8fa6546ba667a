#!/usr/bin/env python3
"""The HAProxy that Serve's front door starts, launched with its configuration hardened (standard library only).

Serve's HAProxy manager (``RAY_SERVE_ENABLE_HA_PROXY``, :mod:`services.platform.front_door`) renders a configuration
and runs ``<binary> -db -f <config> …`` — at start and at every reload — where ``<binary>`` is
``RAY_SERVE_HAPROXY_BINARY_PATH``: this file. Serve's template opens three things Prism does not: a statistics page
on every interface (``listen stats`` / ``bind *:8404``: backends, replica ports and request counts, to anyone who can
reach the node), HAProxy's Prometheus exporter on every interface (``frontend prometheus`` / ``bind :9101``) — both on
fixed ports, which a second cluster on the machine, or an HAProxy left from an earlier one, makes HAProxy fail to
start on — and an admin socket any local user may write (``stats socket … mode 666 level admin``: disable a server,
drop a backend). It also lets a client take an hour (``timeout client``) to send a request's headers, so a few
thousand such connections (``maxconn`` 4096) would shut every other client out; Serve's Python proxy had no bound
either. And an HAProxy outlives its manager actor when ``ray stop`` ends it: nothing else stops it, and it
keeps its ports. Each launch:

1. reads the configuration Serve wrote and writes a hardened copy beside it (``<config>.prism``): the statistics page
   and the exporter removed (Serve reads HAProxy's figures from the admin socket and a log socket, never from
   either), any wildcard bind left put on loopback, the admin socket owner-only, and, where the defaults set no
   ``timeout http-request``, :data:`HEADERS_S` for a request's headers — HAProxy then answers 408 and closes (with
   its own HTML body: HAProxy 2.8 sends its built-in message for this timeout whatever ``errorfile`` says, checked);
   a body's pace is the guard's (``server.body_read_grace_s``, ``body_min_bytes_per_s``);
2. asks the kernel to end it when the process that launched it — the manager — ends (``PR_SET_PDEATHSIG``, which an
   ``exec`` keeps);
3. replaces its own process with the real binary (``PRISM_HAPROXY_BINARY``) on the copy — the same pid, which Serve
   tracks, and every other argument as given (``-sf``/``-x`` for seamless reloads). Serve finds its HAProxy processes
   by the configuration path on their command line, so the original path stays there, as the local peer name
   (``-L``: used only by a ``peers`` section, which Serve's configuration has none of).

Serve's own file is left as written, so its "changed since the last render?" check still compares like with like.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys

ENV_BINARY = "PRISM_HAPROXY_BINARY"
SUFFIX = ".prism"
DROPPED = (["listen", "stats"], ["frontend", "prometheus"])
"""The sections of Serve's configuration that the hardened copy leaves out."""
PR_SET_PDEATHSIG = 1
HEADERS_S = 10
"""Seconds a client has to send a request's headers, from its first byte (or from the end of the last response, on a
kept-alive connection: HAProxy's ``timeout http-keep-alive`` covers the wait before it)."""

_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|peers|resolvers|userlist|program|cache)\b")
_WILDCARD_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|\[::\])?:(\d+)", re.MULTILINE)
_SOCKET_MODE = re.compile(r"^(\s*stats socket\s+\S+.*?\bmode\s+)\d+", re.MULTILINE)


def harden(config: str) -> str:
    """``config`` without the :data:`DROPPED` sections, with every wildcard ``bind`` on 127.0.0.1, the admin socket
    at mode 600 and a :data:`HEADERS_S` bound on a request's headers."""
    kept, skipping = [], False
    bounded = re.search(r"^\s*timeout\s+http-request\s", config, re.MULTILINE) is not None
    for line in config.splitlines(keepends=True):
        if _SECTION.match(line):
            skipping = line.split()[:2] in DROPPED
        if not skipping:
            kept.append(line)
        if not bounded and line.split()[:1] == ["defaults"]:
            kept.append(f"    timeout http-request {HEADERS_S}s\n")
            bounded = True
    out = _WILDCARD_BIND.sub(lambda m: f"{m.group(1)}127.0.0.1:{m.group(2)}", "".join(kept))
    return _SOCKET_MODE.sub(lambda m: f"{m.group(1)}600", out)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # (a reload never reads a half-written file)


def launch_args(argv: list[str]) -> list[str]:
    """The real binary's arguments for this launch's ``argv`` (without the program), the hardened copy written: each
    ``-f <config>`` becomes ``-f <config>.prism -L <config>``."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg != "-f":
            out.append(arg)
            continue
        path = next(args)
        with open(path) as f:
            _write(path + SUFFIX, harden(f.read()))
        out += ["-f", path + SUFFIX, "-L", path]
    return out


def die_with_parent() -> None:
    """SIGTERM (HAProxy's hard stop) to this process, and to the HAProxy it becomes, when its parent ends; at once
    if the parent has ended already."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # (not Linux: no such call, and Serve's own stop is all there is)
        return
    if os.getppid() != parent:
        sys.exit("the HAProxy manager ended before HAProxy started")


def main() -> None:
    binary = os.environ.get(ENV_BINARY, "")
    if not binary:
        sys.exit(f"{ENV_BINARY} is not set: the HAProxy binary to launch is unknown")
    args = launch_args(sys.argv[1:])
    die_with_parent()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
