"""An application of its own in the shared cluster with 2 replicas of encode, prefill and decode (module-scoped: the
cluster's 2 CPUs must hold the other modules' apps once it is gone).

Cache reach: the affinity routers send a repeated image to the encode replica that holds its embeddings and a prompt
that starts like an earlier one to the prefill replica that holds its KV blocks, while a mix of distinct images
spreads over both. Decode migration (last: it kills a replica): the decode replica of a running stream is SIGKILLed,
and the client — the official ``openai`` client, streaming — receives exactly the answer of an undisturbed run, with
no error and no repeated or missing token; the ingress counts the migration and no KV is left on any decode replica."""

from __future__ import annotations

import base64
import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from common.media.synthetic import synthetic_image
from loadtest.chaos import decode_stats
from tests.e2e.conftest import API_KEY
from tests.e2e.prometheus import total, wait_for
from tests.mediakit import jpeg_bytes

APP = "prism-affinity"
MODEL = "prism-tiny-llava"
VISUAL_TOKENS = 144  # the tiny LLaVA's 12 × 12 patch grid: 9 KV blocks of 16


@pytest.fixture(scope="module")
def affinity(prism_server):
    """(base url, http client, config) of the module's application."""
    from ray import serve

    from services.app import build_app

    base, config = prism_server
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    # 0.05 CPU per replica: this app's 8 replicas must fit beside the shared app (and any other module's) in the
    # cluster's 2 CPUs — Serve never starts a replica that does not fit
    one, two = {"num_cpus": 0.05}, {"num_cpus": 0.05, "min_replicas": 2, "max_replicas": 2}
    deployments = {"ingress": {**config["deployments"]["ingress"], **one}, "media": one}
    cfg["deployments"] = {**deployments, "encode": two, "prefill": two, "decode": two}
    # a leaving decode replica's streams move at once (the rolling update's test: the tiny model's streams are shorter
    # than the default grace)
    cfg["server"] = {**cfg.get("server", {}), "drain_grace_s": 0.0}
    serve.run(build_app({"config": cfg}), name=APP, route_prefix="/affinity")
    with httpx.Client(timeout=60) as http:
        yield f"{base}/affinity", http, {**config, "_app": cfg}
    serve.delete(APP)


def _image(seed: int) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(synthetic_image(64, 48, seed=seed))).decode()


def _ask(affinity, image: str | None, question: str) -> dict:
    """The ``prism_trace`` of one request: the image first, then the question."""
    base, http, _ = affinity
    content = ([{"type": "image_url", "image_url": {"url": image}}] if image else []) + [
        {"type": "text", "text": question}
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    r = http.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}", "X-Prism-Trace": "1"},
    )
    assert r.status_code == 200, r.text
    return r.json()["prism_trace"]


def test_a_mix_of_distinct_images_spreads_over_both_replicas(affinity):
    """First in the module, on the app's fresh routers: a router balances its whole recent window, so after a skewed
    run of repeats (the next tests) its new keys go to the lighter replica until the window evens out — a slice of
    traffic taken after other traffic is not the uniform mix this measures."""
    _base, _, config = affinity
    encode, prefill = Counter(), Counter()
    for i in range(32):
        routing = _ask(affinity, _image(1000 + i), "Describe it.")["cache"]["routing"]
        encode[routing["encode"]["replica"]] += 1
        prefill[routing["prefill"]["replica"]] += 1
        assert routing["encode"]["outcome"] == "new"
    for counts in (encode, prefill):
        assert len(counts) == 2, counts
        assert max(counts.values()) <= 2 * min(counts.values()), counts
    # every decision is counted, by stage and outcome, in the ingress's metrics
    # (both series are exported every few seconds, not necessarily in the same scrape: wait for both)
    label = {"application": APP, "stage": "encode", "outcome": "new"}
    prefill_label = {"application": APP, "stage": "prefill"}

    def counted(s) -> bool:
        metric = "ray_prism_route_affinity_total"
        return total(s, metric, **label) >= 32 and total(s, metric, **prefill_label) >= 32

    samples = wait_for(config["_metrics_url"], counted)
    assert total(samples, "ray_prism_route_affinity_total", application=APP, stage="prefill") >= 32


def test_the_same_image_asked_a_new_question_reuses_its_kv_on_the_same_replica(affinity):
    image = _image(901)
    first = _ask(affinity, image, "What colour is the sky in this picture?")
    second = _ask(affinity, image, "How many people are standing there?")
    assert first["visual_tokens"] == VISUAL_TOKENS
    assert first["cache"]["prefix"]["cached_tokens"] == 0
    routing = second["cache"]["routing"]
    assert routing["prefill"] == {"outcome": "owner", "replica": first["cache"]["routing"]["prefill"]["replica"]}
    assert routing["encode"]["replica"] == first["cache"]["routing"]["encode"]["replica"]
    # the hit ends inside the image (the question right after it differs): ≥ 80 % of its visual tokens reused
    assert second["cache"]["prefix"]["cached_visual_tokens"] >= 0.8 * VISUAL_TOKENS
    assert second["cache"]["encoder"] == {"hits": 1, "misses": 0}


def test_a_few_images_asked_again_in_shuffled_order_hit_the_encoder_cache(affinity):
    images = [_image(910 + i) for i in range(4)]
    order = [i for i in range(4) for _ in range(5)]
    random.Random(7).shuffle(order)
    seen: set[int] = set()
    repeats = hits = 0
    for n, i in enumerate(order):
        trace = _ask(affinity, images[i], f"Question number {n}: what is shown?")
        if i in seen:
            repeats += 1
            hits += trace["cache"]["encoder"]["hits"]
            assert trace["cache"]["routing"]["encode"]["outcome"] in ("owner", "spilled")
        seen.add(i)
    assert repeats == 16
    assert hits / repeats >= 0.9, f"{hits} of {repeats} repeats hit the encoder cache"


def test_each_request_decodes_on_the_replica_that_reserved_its_kv(affinity):
    """The ingress reserves a request's KV on a decode replica before prefill; the decode router sends ``generate``
    to that replica (the trace's ``routing.decode`` = the replica named by decode's ``decode.transfer`` span) — also
    with many calls in the router at once (a FIFO router would hand one call's replica to another)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> dict:
        return _ask(affinity, _image(2000 + i) if i % 3 == 0 else None, f"Pinned question {i}?")

    with ThreadPoolExecutor(4) as pool:  # (the ingress admits 4 at a time in this cluster's config)
        traces = list(pool.map(ask, range(24)))
    reserved = Counter()
    for trace in traces:
        route = trace["cache"]["routing"]["decode"]
        (transfer,) = [s for s in trace["spans"] if s["name"] == "decode.transfer"]
        assert route["outcome"] in ("reserved", "waited") and transfer["attrs"]["replica"] == route["replica"], trace
        reserved[route["replica"]] += 1
    assert len(reserved) == 2, reserved  # (24 requests, each to one of 2 replicas at random: both, all but surely)


def _streams(base: str, stop: threading.Event, results: list[dict], client: int) -> None:
    """Greedy streams one after another until ``stop``: each one's finish reason, tokens and migrations."""
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    n = 0
    while not stop.is_set():
        n += 1
        out = {"finish": None, "tokens": 0, "migrations": [], "error": None}
        try:
            for chunk in oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Tell me story number {client}-{n}, a long one."}],
                max_tokens=256,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},  # (every stream its 256 tokens: running when the replica leaves)
                extra_headers={"X-Prism-Trace": "1"},
            ):
                for choice in chunk.choices:
                    out["finish"] = choice.finish_reason or out["finish"]
                    out["tokens"] += 1 if choice.delta.content else 0
                trace = (chunk.model_extra or {}).get("prism_trace")
                if trace:
                    out["migrations"] = trace.get("migrations", [])
        except Exception as exc:  # (recorded: the test says which)
            out["error"] = f"{type(exc).__name__}: {exc}"
        results.append(out)


def test_a_rolling_update_moves_the_streams_of_the_decode_replicas_it_stops(affinity):
    """The application deployed again under a streaming load: Serve replaces every replica (the new one first), and
    each old decode replica leaves its routers' sets while streams run on it; the ingress moves them (this app's
    ``drain_grace_s`` is 0) to a live replica — every stream ends with its finish reason, at least one moved, its
    replay exact, and no KV is held afterwards."""
    from ray import serve

    from services.app import build_app

    base, _, config = affinity
    before = set(decode_stats(APP))
    stop, results = threading.Event(), []
    clients = [threading.Thread(target=_streams, args=(base, stop, results, i), daemon=True) for i in range(3)]
    for t in clients:
        t.start()
    try:
        time.sleep(2)
        serve.run(build_app({"config": config["_app"]}), name=APP, route_prefix="/affinity")
        deadline = time.time() + 120
        while time.time() < deadline and set(decode_stats(APP, timeout=10)) & before:
            time.sleep(1)  # (until the old decode replicas are gone)
        time.sleep(1)
    finally:
        stop.set()
        for t in clients:
            t.join(90)
    failed = [r for r in results if r["error"] or not r["finish"]]
    moved = [m for r in results for m in r["migrations"]]
    print(f"[rolling, 2 replicas] {len(results)} streams, moved: {moved}")
    assert len(results) >= 6 and not failed, failed
    assert any(m["cause"] == "ReplicaLeft" and m["outcome"] == "resumed" for m in moved), moved
    seen = decode_stats(APP)
    assert len(seen) == 2 and not set(seen) & before, seen
    assert all(s["kv_blocks_used"] == 0 and s["running"] == 0 and s["reserved"] == 0 for s in seen.values()), seen
    assert all(s["replay_mismatches"] == 0 for s in seen.values()), seen


@pytest.fixture(scope="module")
def decode(affinity):
    """One decode replica's stats (whichever Serve picks; asked before any replica is killed)."""
    from ray import serve

    handle = serve.get_deployment_handle("Decode", app_name=APP)
    return lambda: handle.stats.remote().result(timeout_s=30)


LONG = {"return_token_ids": True, "ignore_eos": True}


def _long_answer(oai: openai.OpenAI) -> tuple[list[dict], openai.types.chat.ChatCompletion]:
    """A prompt whose greedy answer runs long, and that answer: 256 tokens past any EOS (``ignore_eos``: with the C
    decoder layers on an AVX2 CPU, a CI run saw an answer that ended at its EOS done before the client read its first
    chunk, and every stream of the rolling update done before its replica left)."""
    for i in range(12):
        messages = [{"role": "user", "content": f"Tell me story number {i}, a long one."}]
        calm = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=256, temperature=0, extra_body=LONG
        )
        if calm.usage.completion_tokens >= 120:
            return messages, calm
    pytest.fail("no prompt gave an answer of 120 tokens or more")


def _kill_the_busy_replica(decode) -> int | None:
    """SIGKILL the decode replica that is running a sequence (``stats`` is answered by either replica)."""
    for _ in range(40):
        stats = decode()
        if stats["running"] > 0:
            os.kill(int(stats["pid"]), signal.SIGKILL)
            return int(stats["pid"])
    return None


def test_a_stream_survives_the_loss_of_its_decode_replica(affinity, decode):
    """Last in the module: it kills a decode replica."""
    base, _, config = affinity
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    messages, calm = _long_answer(oai)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=256,
        temperature=0,
        stream=True,
        extra_body=LONG,
        extra_headers={"X-Prism-Trace": "1"},
    )
    text, ids, finish, trace, killed = "", [], None, None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
            if killed is None and choice.delta.content:
                killed = _kill_the_busy_replica(decode)  # as soon as the first token is out
        trace = (chunk.model_extra or {}).get("prism_trace") or trace
    assert killed is not None, "the stream ended before its decode replica could be found"
    assert text == calm.choices[0].message.content
    assert ids == calm.choices[0].model_extra["token_ids"]
    assert finish == calm.choices[0].finish_reason
    (moved,) = trace["migrations"]
    assert moved["after_tokens"] >= 1, moved  # tokens were replayed, not recomputed from scratch
    samples = wait_for(
        config["_metrics_url"],
        lambda s: total(s, "ray_prism_migrations_total", application=APP, outcome="resumed") >= 1,
    )
    assert total(samples, "ray_prism_migrations_total", application=APP, outcome="resumed") >= 1
    # the replacement replica comes up; no decode replica holds KV, and the survivor replayed exactly
    seen = decode_stats(APP)
    assert len(seen) == 2 and killed not in seen, seen
    assert all(s["kv_blocks_used"] == 0 and s["running"] == 0 and s["reserved"] == 0 for s in seen.values()), seen
    assert sum(s["replayed_tokens"] for s in seen.values()) >= moved["after_tokens"]
    assert all(s["replay_mismatches"] == 0 for s in seen.values()), seen
