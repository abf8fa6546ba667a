"""``make chaos``: steady load on Prism with 2 replicas per stage while one replica of each stage is SIGKILLed.

Not part of ``make test``: it takes minutes and kills processes. It starts a local Ray cluster of its own (with the
dashboard, whose state API gives each replica's PID) and the application from the default Serve config's Prism
settings, scaled to two replicas of every deployment — media, encode, prefill and decode, or the groups of
``--topology`` (``E/PD``: media, encode, prefill+decode) — and one ingress (its in-flight HTTP requests would die with
it). Clients send a steady mix — text and small images, half of them streamed — while the tool kills, a few seconds
apart, one replica of each deployment in request order (``SIGKILL`` of the replica's process; Serve starts a
replacement). The replica killed of the deployment that holds decode is one with a sequence in flight that still has
tokens to go (:func:`pick_decode_victim`, asked through ``stats`` for up to :data:`VICTIM_WAIT_S`), so that the kill
exercises a migration whatever the load's timing (``decode_victim_had_a_sequence_in_flight`` in the output). Then
the load stops and it prints, as JSON, what the clients saw: requests by status, streams that ended with a finish
reason, failures by stage killed before them, the longest gap without a completed request, and the KV blocks still in
use (and KV reservations still held) on every decode replica once the load drained.

    make chaos [CHAOS_FLAGS="--clients 4 --gap 6 --model prism-tiny-llava --topology E/PD"]

The issue it answers (16) asks for every request 200 and no gap over 5 s. Every request asks for its trace, so the
output also counts the decode migrations the clients' requests went through (requests migrated, tokens replayed, the
longest time from the loss to the resumed stream): a request whose decode replica died mid-generation completes
unseen, on the other replica.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import httpx

from common.config.topology import Topology, deployment_names, group_name, group_of
from common.media.synthetic import synthetic_image

KEY = "chaos-key"
STAGES = ("Media", "Encode", "Prefill", "Decode")


@dataclass
class Outcome:
    start: float
    end: float
    status: int
    streamed: bool
    finish_reason: str | None = None
    error: str = ""
    migrations: list[dict[str, Any]] = field(default_factory=list)
    """The request's decode migrations, from its trace (``after_tokens``, ``ms``, ``cause``, ``outcome``)."""

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finish_reason is not None


def app_config(model: str, cache_dir: str | None = None, topology: str = "E/P/D") -> dict[str, Any]:
    two = {"num_cpus": 0.1, "min_replicas": 2, "max_replicas": 2}
    model_cfg = {"model": model, "torch_threads": 1, **({"cache_dir": cache_dir} if cache_dir else {})}
    stages = {s.lower(): two for s in STAGES}
    return {
        "model": model_cfg,
        "server": {"api_keys": {KEY: "chaos"}, "max_chain_attempts": 3},
        "deployments": {"ingress": {"num_cpus": 0.1}, "topology": topology, **stages},
    }


VICTIM_WAIT_S = 15.0
"""How long the kill of the decode deployment waits for a replica with a sequence in flight (then it kills another)."""
VICTIM_TOKENS_LEFT = 8
"""Tokens a sequence must have left for its replica to be the decode victim: enough that it is still decoding when the
signal lands (a decode step of the tiny models takes milliseconds; the ``stats`` answer and the kill, a few)."""


def pick_decode_victim(
    ask: Callable[[float], list[dict[str, Any]]],
    pids: list[int],
    timeout: float = VICTIM_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> int | None:
    """The PID (of ``pids``) of a decode replica that has a sequence in flight with at least
    :data:`VICTIM_TOKENS_LEFT` tokens to go, by its ``stats`` — asked in rounds until one answers so or ``timeout``
    passes (then ``None``). ``ask(seconds)``: one round's answers (:func:`_ask_stats`), each call bounded by
    ``seconds``, those that failed left out."""
    deadline = clock() + timeout
    while (left := deadline - clock()) > 0:
        for stats in ask(min(10.0, left)):
            busy = int(stats.get("running", 0)) > 0 and int(stats.get("most_tokens_left", 0)) >= VICTIM_TOKENS_LEFT
            if busy and int(stats["pid"]) in pids:
                return int(stats["pid"])
        pause(0.02)
    return None


def _ask_stats(app: str, deployment: str, replicas: int) -> Callable[[float], list[dict[str, Any]]]:
    """A round of ``stats`` calls to the decode deployment: two per replica, sent together. One call at a time would
    mostly reach the less busy replica (Serve sends a call to the shorter of two queues); calls sent together spread,
    since the router counts each one it sends in its replica's queue."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    handle = serve.get_deployment_handle(deployment, app_name=app)

    def ask(seconds: float) -> list[dict[str, Any]]:
        out = []
        for response in [handle.stats.remote() for _ in range(2 * replicas)]:
            try:
                out.append(response.result(timeout_s=seconds))
            except (RayError, RayServeException, TimeoutError):  # (a replica just killed or replaced: next round)
                pass
        return out

    return ask


def decode_deployment(topology: str) -> str:
    """The deployment that holds decode in ``topology`` (``Decode``, ``PrefillDecode``, ``EncodePrefillDecode``)."""
    return group_name(group_of(topology, "decode"))


def _image(seed: int) -> str:
    buf = io.BytesIO()
    synthetic_image(96, 72, seed=seed).save(buf, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, n: int, stream: bool, max_tokens: int = 48) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Tell me about item {n}."}]
    if n % 2 == 0:
        content.insert(0, {"type": "image_url", "image_url": {"url": _image(n)}})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return {**body, "stream": stream}


def one_request(
    http: httpx.Client, url: str, body: dict[str, Any], key: str = KEY, on_choices: Callable[[int], None] | None = None
) -> Outcome:
    """One request and what its client saw; a stream's ``on_choices`` is told how many choice chunks have arrived,
    after each event that carries some."""
    start, headers = time.time(), {"Authorization": f"Bearer {key}", "X-Prism-Trace": "1"}
    try:
        if not body["stream"]:
            r = http.post(url, json=body, headers=headers)
            if r.status_code != 200:
                return Outcome(start, time.time(), r.status_code, False, None, r.text)
            answer = r.json()
            moved = answer.get("prism_trace", {}).get("migrations", [])
            return Outcome(start, time.time(), 200, False, answer["choices"][0]["finish_reason"], "", moved)
        reason, error, moved, chunks = None, "", [], 0
        with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return Outcome(start, time.time(), r.status_code, True, None, r.read().decode(errors="replace"))
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = json.dumps(event["error"])
                moved = event.get("prism_trace", {}).get("migrations", moved)
                for choice in event.get("choices") or []:
                    reason = choice.get("finish_reason") or reason
                    chunks += 1
                if on_choices is not None and event.get("choices"):
                    on_choices(chunks)
        return Outcome(start, time.time(), 200, True, reason, error, moved)
    except httpx.HTTPError as exc:
        return Outcome(start, time.time(), 0, body["stream"], None, type(exc).__name__)


def client(
    base: str, model: str, index: int, stop: threading.Event, out: list[Outcome], key: str = KEY, max_tokens: int = 48
) -> None:
    """Requests one after another until ``stop``: text and small images alternating, half of them streamed."""
    url = f"{base}/v1/chat/completions"
    n = index
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            out.append(one_request(http, url, _body(model, n, stream=n % 4 < 2, max_tokens=max_tokens), key))
            n += 97


def longest_gap(outcomes: list[Outcome], start: float, end: float) -> float:
    """Longest time in [start, end] without a completed request."""
    ends = sorted(o.end for o in outcomes if o.complete and start <= o.end <= end)
    return max(b - a for a, b in itertools.pairwise([start, *ends, end]))


def summarize(outcomes: list[Outcome], kills: list[tuple[str, float]], start: float, end: float) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
    failed = [o for o in outcomes if not o.complete]
    after: dict[str, int] = {}
    for o in failed:
        last = [stage for stage, t in kills if t <= o.end]
        after[last[-1] if last else "none"] = after.get(last[-1] if last else "none", 0) + 1
    return {
        "requests": len(outcomes),
        "complete": len(outcomes) - len(failed),
        "by_status": by_status,
        "streams": sum(o.streamed for o in outcomes),
        "streams_complete": sum(o.streamed and o.complete for o in outcomes),
        "failed_after_kill_of": after,
        "failures": [asdict(o) | {"error": o.error[:200]} for o in failed][:20],
        "migrated": {
            "requests": sum(bool(o.migrations) for o in outcomes),
            "complete": sum(bool(o.migrations) and o.complete for o in outcomes),
            "tokens_replayed": sum(m["after_tokens"] for o in outcomes for m in o.migrations),
            "longest_resume_ms": max((m["ms"] for o in outcomes for m in o.migrations), default=0),
        },
        "longest_gap_s": round(longest_gap(outcomes, start, end), 2),
        "kills": [{"stage": s, "at_s": round(t - start, 1)} for s, t in kills],
    }


def replica_pids(app: str, stage: str) -> list[int]:
    from ray.util.state import list_actors

    name = f"{app}#{stage}"
    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return sorted(a.pid for a in actors if a.name and name in a.name and a.pid)


def decode_stats(
    app: str, replicas: int = 2, timeout: float = 90.0, deployment: str = "Decode"
) -> dict[int, dict[str, Any]]:
    """Each decode replica's ``stats`` by PID (answered by whichever replica Serve picks: asked until ``replicas``
    distinct ones answered — a killed one's replacement included — or ``timeout``; a call Serve still sent to a
    replica just killed is asked again). ``deployment``: the one that holds decode (``PrefillDecode`` in ``E/PD``)."""
    from ray import serve
    from ray.exceptions import RayActorError

    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.time() + timeout
    while len(seen) < replicas and time.time() < deadline:
        try:
            stats = handle.stats.remote().result(timeout_s=30)
        except RayActorError:
            time.sleep(0.5)
            continue
        seen[int(stats["pid"])] = stats
        time.sleep(0.05)
    return seen


def kv_in_use(
    app: str, replicas: int = 2, timeout: float = 90.0, deployment: str = "Decode"
) -> dict[str, dict[str, int]]:
    """KV blocks used and KV reservations held (unclaimed) per decode replica, by PID."""
    stats = decode_stats(app, replicas, timeout, deployment)
    return {str(pid): {"blocks": int(s["kv_blocks_used"]), "reserved": int(s["reserved"])} for pid, s in stats.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="prism-tiny-llava")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warm", type=float, default=8.0, help="seconds of load before the first kill")
    parser.add_argument("--gap", type=float, default=6.0, help="seconds between kills, and after the last")
    parser.add_argument("--topology", default="E/P/D", choices=list(get_args(Topology)))
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from loadtest.bench_servers import ray_start_env, wait_ready
    from loadtest.ports import free_port
    from services.app import build_app

    app = "chaos"
    port = free_port()
    os.environ.update(ray_start_env())
    ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_port=free_port(), log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = app_config(args.model, args.cache_dir, args.topology)
        serve.run(build_app({"config": config}), name=app, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, key=KEY)
        stop, outcomes = threading.Event(), []
        threads = [
            threading.Thread(target=client, args=(base, args.model, i, stop, outcomes), daemon=True)
            for i in range(args.clients)
        ]
        start = time.time()
        for t in threads:
            t.start()
        time.sleep(args.warm)
        kills, streaming = [], None
        for stage in deployment_names(args.topology):  # (in request order)
            pids = replica_pids(app, stage)
            if not pids:
                raise RuntimeError(f"no live replica of {stage} to kill")
            pid = pids[0]
            if stage == decode_deployment(args.topology):
                found = pick_decode_victim(_ask_stats(app, stage, len(pids)), pids)
                streaming, pid = found is not None, found or pid
            os.kill(pid, signal.SIGKILL)
            kills.append((stage, time.time()))
            print(f"[chaos {time.time() - start:5.1f}s] SIGKILL {stage} replica (pid {pid})", file=sys.stderr)
            time.sleep(args.gap)
        stop.set()
        for t in threads:
            t.join(90)
        end = time.time()
        result = summarize(outcomes, kills, start, end)
        result["decode_victim_had_a_sequence_in_flight"] = streaming
        result["kv_blocks_used_after"] = kv_in_use(app, deployment=decode_deployment(args.topology))
        result["config"] = {
            "model": args.model,
            "clients": args.clients,
            "replicas_per_deployment": 2,
            "topology": args.topology,
        }
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
