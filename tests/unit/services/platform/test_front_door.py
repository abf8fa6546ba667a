"""The front door's HAProxy: the environment that puts it in the proxy's place, and the launcher that hardens the
configuration Serve renders before the real binary reads it (:mod:`services.platform.front_door`,
:mod:`services.platform.haproxy_launch`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from services.platform import front_door
from services.platform.haproxy_launch import ENV_BINARY, HEADERS_S, SUFFIX, harden, launch_args

# The parts of a configuration Serve 2.60's template renders that the launcher touches, and some it must not.
SERVE_CONFIG = """global
    log 127.0.0.1:514 local0 info
    stats socket /tmp/haproxy-serve/x/admin.sock mode 666 level admin expose-fd listeners
    stats timeout 30s
defaults
    mode http
    timeout connect 5s
frontend prometheus
    bind :9101
    mode http
    http-request use-service prometheus-exporter if { path /metrics }
frontend http_frontend
    bind 127.0.0.1:8000
    default_backend http-prism
frontend grpc_frontend
    bind 127.0.0.1:9000 proto h2
backend http-prism
    server prism-1 127.0.0.1:30000 check
    server prism-2 10.0.0.7:30001 check
listen stats
  bind *:8404
  stats enable
  stats uri /stats
  stats refresh 1s
"""


def test_the_statistics_page_and_the_exporter_go_and_nothing_else_listens_beyond_where_serve_said():
    # every other line as Serve wrote it, in its order (the replicas, wherever they are, included)
    assert harden(SERVE_CONFIG) == (
        "global\n"
        "    log 127.0.0.1:514 local0 info\n"
        "    stats socket /tmp/haproxy-serve/x/admin.sock mode 600 level admin expose-fd listeners\n"
        "    stats timeout 30s\n"
        "defaults\n"
        f"    timeout http-request {HEADERS_S}s\n"
        "    mode http\n"
        "    timeout connect 5s\n"
        "frontend http_frontend\n"
        "    bind 127.0.0.1:8000\n"
        "    default_backend http-prism\n"
        "frontend grpc_frontend\n"
        "    bind 127.0.0.1:9000 proto h2\n"
        "backend http-prism\n"
        "    server prism-1 127.0.0.1:30000 check\n"
        "    server prism-2 10.0.0.7:30001 check\n"
    )


def test_a_requests_headers_get_a_bound_unless_serve_set_one():
    out = harden(SERVE_CONFIG).splitlines()
    assert out[out.index("defaults") + 1] == f"    timeout http-request {HEADERS_S}s"
    assert sum("http-request" in line and "timeout" in line for line in out) == 1
    own = SERVE_CONFIG.replace("    timeout connect 5s\n", "    timeout connect 5s\n    timeout http-request 3s\n")
    assert "timeout http-request 3s" in harden(own) and f"http-request {HEADERS_S}s" not in harden(own)


def test_wildcard_binds_of_any_spelling_move_to_loopback():
    for bind in ("*:8000", ":8000", "0.0.0.0:8000", "[::]:8000"):
        assert harden(f"frontend f\n    bind {bind} proto h2\n") == "frontend f\n    bind 127.0.0.1:8000 proto h2\n"


def test_each_launch_writes_the_hardened_copy_and_keeps_the_original_path_on_the_command_line(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG)
    args = launch_args(["-db", "-f", str(config), "-dR", "-sf", "123", "-x", "/sock"])
    assert args == ["-db", "-f", f"{config}{SUFFIX}", "-L", str(config), "-dR", "-sf", "123", "-x", "/sock"]
    assert config.read_text() == SERVE_CONFIG  # (Serve's own file as it wrote it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haproxy.cfg", f"haproxy.cfg{SUFFIX}"]  # no temp left
    assert Path(f"{config}{SUFFIX}").read_text() == harden(SERVE_CONFIG)


def test_the_launcher_runs_the_real_binary_in_its_own_process_on_the_hardened_copy(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG)
    fake = tmp_path / "haproxy"  # prints its pid, its arguments and the file it was given
    fake.write_text(f"#!{sys.executable}\nimport os, sys\nprint(os.getpid()); print(sys.argv[1:])\n")
    fake.chmod(0o755)
    script = f"import os, sys; print(os.getpid(), flush=True); os.execv({str(front_door.LAUNCHER)!r}, sys.argv[1:])"
    run = subprocess.run(
        [sys.executable, "-c", script, str(front_door.LAUNCHER), "-db", "-f", str(config)],
        env={**os.environ, ENV_BINARY: str(fake)},
        capture_output=True,
        text=True,
        check=True,
    )
    pid, fake_pid, argv = run.stdout.splitlines()
    assert pid == fake_pid  # the pid Serve started is HAProxy's
    assert argv == str(["-db", "-f", f"{config}{SUFFIX}", "-L", str(config)])


def test_haproxy_ends_with_the_process_that_launched_it(tmp_path):
    """``ray stop`` ends Serve's HAProxy manager without a word to its HAProxy: the kernel's parent-death signal then
    ends HAProxy rather than leave it holding its ports."""
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG)
    fake, pidfile = tmp_path / "haproxy", tmp_path / "pid"
    fake.write_text(
        f"#!{sys.executable}\nimport os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    manager = (  # launches HAProxy as Serve's manager does, then ends as a killed actor would
        "import subprocess, sys, time, os;"
        f"subprocess.Popen([{str(front_door.LAUNCHER)!r}, '-db', '-f', {str(config)!r}]);"
        f"[time.sleep(0.05) for _ in range(200) if not os.path.exists({str(pidfile)!r})]; os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", manager], env={**os.environ, ENV_BINARY: str(fake)}, check=True, timeout=30)
    pid = int(pidfile.read_text())
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text():
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("HAProxy outlived the process that launched it")


def test_without_the_real_binary_the_launcher_says_so():
    run = subprocess.run(
        [str(front_door.LAUNCHER), "-db"],
        env={k: v for k, v in os.environ.items() if k != ENV_BINARY},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and ENV_BINARY in run.stderr


def test_the_environment_names_serves_haproxy_the_launcher_and_the_bundled_binary():
    env = front_door.env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(front_door.LAUNCHER)
    assert os.access(front_door.LAUNCHER, os.X_OK)  # (Serve refuses a path it cannot execute)
    assert Path(env[ENV_BINARY]).name == "haproxy" and os.access(env[ENV_BINARY], os.X_OK)
    assert Path(env[ENV_BINARY]) != front_door.LAUNCHER
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) == front_door.MIN_DRAINING_S
