"""A stopping worker pod's preStop: drain its Ray node, let Serve move its replicas away, then stop Ray.

Lifecycle — Kubernetes runs ``python -m services.platform.drain --grace-s G`` when it stops a Ray worker pod (a node
drain, an upgrade, a scale-down) and kills the container at the pod's ``terminationGracePeriodSeconds`` (the chart
sets ``drain.graceSeconds`` + 30):

1. **Drain** — ``ray drain-node`` for this node (reason preemption, deadline G): the GCS marks the node draining and
   its raylet takes no new work. Serve's controller watches draining nodes: for each replica here it starts a
   replacement on another node first, then stops this one (its graceful shutdown lets short requests finish; a decode
   stream cut off moves to a live replica by the ingress's migration).
2. **Wait** until no Serve replica is alive on the node, or G runs out (polled through the GCS actor table).
3. **Stop** — ``ray stop``, always: a refused drain or an unreachable GCS only skips ahead to it.

:func:`drain_and_wait` is steps 1 and 2 for any node (what the multi-node tests call); :func:`main` is the preStop.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REASON = "DRAIN_NODE_REASON_PREEMPTION"
"""Ray's reason for a node that goes away whether or not it is idle (its work must move)."""
_RAY = str(Path(sys.executable).parent / "ray")  # (the ray CLI of this environment, whatever PATH says)


def drain_node(node_id: str, grace_s: int, address: str) -> bool:
    """Ask the GCS at ``address`` to drain ``node_id`` with a deadline ``grace_s`` from now; True if accepted."""
    cmd = [_RAY, "drain-node", f"--address={address}", f"--node-id={node_id}", f"--reason={REASON}"]
    cmd += ["--reason-message=pod stopping (prism preStop)", f"--deadline-remaining-seconds={grace_s}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        print(f"[prism-drain] drain of {node_id[:12]} refused: {done.stderr.strip()[-300:]}", flush=True)
    return done.returncode == 0


def serve_replicas() -> list[tuple[str, str, str]]:
    """``(application, deployment, node id)`` of every Serve replica actor alive in the cluster, from the GCS actor
    table (no dashboard needed; the driver is connected). ``ray._private.state`` is Ray's own reader of that table,
    stable across the versions this project pins."""
    from ray._private import state

    out = []
    for info in state.actors().values():
        name = info.get("Name") or ""
        parts = name.removeprefix("SERVE_REPLICA::").split("#")  # SERVE_REPLICA::<app>#<deployment>#<id>
        if info.get("State") == "ALIVE" and name.startswith("SERVE_REPLICA::") and len(parts) == 3:
            out.append((parts[0], parts[1], (info.get("Address") or {}).get("NodeID", "")))
    return out


def serve_replicas_on(node_id: str) -> int:
    """Serve replica actors alive on ``node_id``."""
    return sum(node == node_id for _, _, node in serve_replicas())


def drain_and_wait(
    node_id: str,
    grace_s: int,
    address: str,
    poll_s: float = 1.0,
) -> int:
    """Drain ``node_id`` and wait until no Serve replica is alive on it or ``grace_s`` passed; returns the replicas
    still there (0: drained). A refused drain waits for nothing."""
    deadline = time.monotonic() + grace_s
    if not drain_node(node_id, grace_s, address):
        return serve_replicas_on(node_id)
    left = serve_replicas_on(node_id)
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = serve_replicas_on(node_id)
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.platform.drain", description=__doc__.split("\n")[0])
    parser.add_argument("--grace-s", type=int, default=120, help="seconds the node may take to drain")
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: the one this node is part of)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        import ray

        ray.init(address=args.address, log_to_driver=False, logging_level="WARNING")
        context = ray.get_runtime_context()
        node = context.get_node_id()
        left = drain_and_wait(node, args.grace_s, context.gcs_address)
        took = time.monotonic() - started
        print(f"[prism-drain] node {node[:12]}: {left} Serve replicas left after {took:.1f} s", flush=True)
    except Exception as exc:  # (whatever failed, Ray still stops: the pod is going either way)
        print(f"[prism-drain] could not drain ({type(exc).__name__}: {exc}); stopping Ray", flush=True)
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        subprocess.run([_RAY, "stop"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
