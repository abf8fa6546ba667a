"""Prism across nodes: each deployment's replicas on the node of its group, embeddings and KV crossing nodes through
the object store (``E/P/D``) and through NIXL (``E/PD``: the embeddings cross nodes into the prefill+decode replica)
with the same tokens as the in-process reference, and a decode node removed under load
without a lost or hung request (its streams migrate; its replica comes back on the other decode node).

The figures each run measures (bytes and time of the cross-node hand-offs, outcomes of the node loss) are printed as
JSON lines prefixed ``[multinode]`` (``pytest -s tests/multinode`` shows them)."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from loadtest.chaos import Outcome, one_request, summarize
from loadtest.chaos import client as load_client
from tests.multinode.conftest import API_KEY, APPS, MODEL, TOPOLOGY, replicas_by_node

GROUP_OF = {
    "Ingress": "media",
    "Media": "media",
    "Encode": "encode",
    "Prefill": "prefill",
    "Decode": "decode",
    "PrefillDecode": "decode",  # (E/PD: the group runs where its last stage would)
}
DECODE_OF = {"E/P/D": "Decode", "E/PD": "PrefillDecode"}
"""topology → the deployment that holds decode."""


def _report(what: str, **figures) -> None:
    print(f"[multinode] {json.dumps({'what': what, **figures})}")


def test_each_stage_runs_on_the_nodes_of_its_group(cluster):
    _, nodes, _ = cluster
    node_ids = {group: node.node_id for group, node in nodes.items()}
    decode_nodes = {node_ids["decode"], node_ids["decode-2"]}
    for transport, (name, _, decode_replicas) in APPS.items():
        placed = replicas_by_node(name)
        decode = DECODE_OF[TOPOLOGY[transport]]
        expected = {"Ingress", "Media", "Encode", decode} | ({"Prefill"} if decode == "Decode" else set())
        assert set(placed) == expected, placed
        for deployment, on in placed.items():
            group = GROUP_OF[deployment]
            allowed = decode_nodes if group == "decode" else {node_ids[group]}
            assert set(on) <= allowed, (name, deployment, on)
        assert len(placed[decode]) == decode_replicas
    # the two decode replicas of the first app are spread over both decode nodes
    assert set(replicas_by_node(APPS["object_store"][0])["Decode"]) == decode_nodes


def _png(seed: int) -> str:
    buf = io.BytesIO()
    synthetic_image(200, 150, seed=seed).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("transport", list(APPS))
def test_hand_offs_cross_nodes_and_tokens_match_the_reference(cluster, tiny_llava, transport):
    base, _, _ = cluster
    name, prefix, _ = APPS[transport]
    oai = openai.OpenAI(base_url=f"{base}{prefix}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for images in ([], [3]):
        text = "Describe it." if images else "Count to five."
        content = [{"type": "image_url", "image_url": {"url": _png(s)}} for s in images]
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True},
            extra_headers={"X-Prism-Trace": "1"},
        )
        ref = run_request(
            tiny_llava,
            [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}],
            [synthetic_image(200, 150, seed=s) for s in images],
            SamplingParams(max_tokens=16),
        )
        assert r.model_extra["prompt_token_ids"] == list(ref.prompt_token_ids)
        assert r.choices[0].model_extra["token_ids"] == list(ref.output.token_ids)
        spans = {s["name"]: s for s in r.model_extra["prism_trace"]["spans"]}
        kv = spans["decode.transfer"]
        grouped = TOPOLOGY[transport] == "E/PD"  # (prefill and decode in one replica: the KV stays in it)
        assert kv["attrs"]["backend"] == ("in_process" if grouped else transport) and kv["attrs"]["bytes"] > 0
        figures = {"kv_bytes": kv["attrs"]["bytes"], "kv_ms": kv["duration_ms"]}
        if images:  # embeddings: encode node → prefill node, through the same transport as the KV
            emb = spans["prefill.transfer"]
            assert emb["attrs"]["backend"] == transport and emb["attrs"]["bytes"] > 0
            figures |= {"embedding_bytes": emb["attrs"]["bytes"], "embedding_ms": emb["duration_ms"]}
        _report("hand-off", app=name, transport=transport, topology=TOPOLOGY[transport], images=len(images), **figures)


LOAD_TOKENS = 96
"""``max_tokens`` of the load's requests."""
WITNESS_TOKENS = 512
"""``max_tokens`` of the witness stream (EOS ignored): more than any load request may have left, so the decode replica
whose stats show more than :data:`LOAD_TOKENS` to go is the one generating it."""


def _witness(url: str, started: threading.Event, out: list[Outcome]) -> None:
    """One long stream that sets ``started`` once its first tokens arrived (its decode stream has started: a replica
    lost now is migrated, not retried) and appends its :class:`Outcome` (with its trace's migrations) to ``out``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": WITNESS_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.Client(timeout=60) as http:
            out.append(one_request(http, url, body, API_KEY, on_choices=lambda n: n >= 8 and started.set()))
    finally:
        started.set()  # (whatever happened: the test reads the outcome)


def test_a_decode_node_removed_under_load_loses_no_request(cluster):
    """Half the requests stream; the decode node leaves mid-load: its streams migrate to the other decode node, Serve
    starts its replica again there, and every request completes — none fails, none hangs. The node removed is the one
    generating a long witness stream whose first tokens the client has received, so a stream is certainly moved (the
    load's own requests may all be between stages, or before their first token, at that moment: CI runs saw nothing
    migrate)."""
    from ray import serve

    base, nodes, ray_cluster = cluster
    name, prefix, _ = APPS["object_store"]
    stop, outcomes, witnessed, started = threading.Event(), [], [], threading.Event()
    args = (f"{base}{prefix}", MODEL)
    kw = {"key": API_KEY, "max_tokens": LOAD_TOKENS}
    threads = [
        threading.Thread(target=load_client, args=(*args, i, stop, outcomes), kwargs=kw, daemon=True) for i in range(3)
    ]
    url = f"{base}{prefix}/v1/chat/completions"
    witness = threading.Thread(target=_witness, args=(url, started, witnessed), daemon=True)
    start = time.time()
    for t in threads:
        t.start()
    try:
        time.sleep(5)
        # (before the witness, so that its window is not spent on them: the GCS query, and the first call of the
        # decode handle, which waits for its router to learn the replicas — a CI run saw the witness end meanwhile)
        where = _decode_nodes_by_pid(nodes)
        decode = serve.get_deployment_handle("Decode", app_name=name)
        decode.stats.remote().result(timeout_s=30)
        witness.start()
        assert started.wait(60) and not witnessed, witnessed
        gone, pid = _witness_decode_node(decode, where)
        removed_at = time.time()
        try:  # the replica first, at once: while the node goes, the witness could finish
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        ray_cluster.remove_node(nodes[gone], allow_graceful=False)  # a lost machine: raylet and workers killed
        time.sleep(10)
    finally:
        stop.set()
        for t in [*threads, witness]:
            t.join(90)
    end = time.time()
    summary = summarize([*outcomes, *witnessed], [("Decode", removed_at)], start, end)
    _report("decode node removed", **{k: v for k, v in summary.items() if k != "failures"})
    assert summary["requests"] >= 6 and not any(t.is_alive() for t in [*threads, witness])
    assert summary["complete"] == summary["requests"], summary["failures"]
    assert max(o.end - o.start for o in outcomes) < 30, "a request hung"
    [moved] = witnessed  # the witness went on on the other decode node, to its last token
    assert moved.finish_reason == "length" and moved.migrations[-1]["outcome"] == "resumed", moved
    # the stage is whole again: two decode replicas, now both on the remaining decode node
    survivor = nodes["decode-2" if gone == "decode" else "decode"].node_id
    deadline = time.time() + 120
    while time.time() < deadline:
        status = serve.status().applications[name].deployments["Decode"]
        running = sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))
        if running == 2 and replicas_by_node(name).get("Decode") == [survivor, survivor]:
            break
        time.sleep(1)
    assert replicas_by_node(name)["Decode"] == [survivor, survivor]


def _decode_nodes_by_pid(nodes: dict) -> dict[int, str]:
    """PID of every live actor on a decode node → that node's group name (``decode`` / ``decode-2``)."""
    from ray._private import state

    group_of_node = {node.node_id: group for group, node in nodes.items() if group.startswith("decode")}
    alive = [info for info in state.actors().values() if info.get("State") == "ALIVE" and info.get("Pid")]
    return {
        info["Pid"]: group_of_node[info["Address"]["NodeID"]]
        for info in alive
        if info["Address"]["NodeID"] in group_of_node
    }


def _witness_decode_node(handle, where: dict[int, str]) -> tuple[str, int]:
    """The group name of the node whose decode replica generates the witness stream, and that replica's PID: the
    first stats answer (through ``handle``, the decode deployment's) with more than :data:`LOAD_TOKENS` to go (asked
    until the witness could have ended)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = handle.stats.remote().result(timeout_s=30)
        if stats["most_tokens_left"] > LOAD_TOKENS:
            pid = int(stats["pid"])
            assert pid in where, f"the witness's decode replica {pid} is no live actor of a decode node: {where}"
            return where[pid], pid
        time.sleep(0.01)
    raise AssertionError("no decode replica was generating the witness stream")


def test_a_drained_decode_node_hands_its_replicas_over_under_load(cluster):
    """A pod's preStop drains its Ray node (:mod:`services.platform.drain`): with a new decode node in the cluster,
    a node that holds decode replicas is drained under a streaming load — Serve starts each replica's replacement on
    another node and then stops the drained one's, within the grace; no request fails or hangs."""
    from ray import serve

    from services.platform.drain import drain_and_wait
    from tests.multinode.conftest import STORE_MB, chart_cluster_shape

    base, _, ray_cluster = cluster
    name, prefix, _ = APPS["object_store"]
    _, groups = chart_cluster_shape()
    fresh = ray_cluster.add_node(num_cpus=1, resources=groups["decode"], object_store_memory=STORE_MB * 2**20)
    ray_cluster.wait_for_nodes()
    drained = replicas_by_node(name)["Decode"][0]  # (after the node removal above: the node holding both)
    stop, outcomes = threading.Event(), []
    kw = {"key": API_KEY, "max_tokens": LOAD_TOKENS}
    threads = [
        threading.Thread(target=load_client, args=(f"{base}{prefix}", MODEL, i, stop, outcomes), kwargs=kw, daemon=True)
        for i in range(3)
    ]
    start = time.time()
    for t in threads:
        t.start()
    try:
        time.sleep(4)
        began = time.time()
        left = drain_and_wait(drained, 90, ray_cluster.address)
        took = time.time() - began
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    summary = summarize(outcomes, [("Decode", began)], start, time.time())
    _report("decode node drained", drain_s=round(took, 1), **{k: v for k, v in summary.items() if k != "failures"})
    assert left == 0 and took < 90, "every Serve replica left the drained node within the grace"
    assert summary["requests"] >= 6 and not any(t.is_alive() for t in threads)
    assert summary["complete"] == summary["requests"], summary["failures"]
    assert max(o.end - o.start for o in outcomes) < 30, "a request hung"
    status = serve.status().applications[name].deployments["Decode"]
    assert sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING")) == 2
    moved = replicas_by_node(name)["Decode"]
    assert len(moved) == 2 and drained not in moved and fresh.node_id in moved
