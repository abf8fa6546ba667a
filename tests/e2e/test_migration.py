"""Decode migration end to end: the decode replica of a running stream is SIGKILLed, and the client — the official
``openai`` client, streaming — receives exactly the answer of an undisturbed run, with no error and no repeated or
missing token; the ingress counts the migration and no KV is left on any decode replica (the scaled-out application
of the shared cluster: 2 decode replicas, so one serves on while Serve replaces the other)."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from tests.e2e.conftest import API_KEY, SCALED_APP
from tests.e2e.prometheus import total, wait_for

MODEL = "prism-tiny-llava"


@pytest.fixture(scope="module")
def decode(scaled_out):
    from ray import serve

    handle = serve.get_deployment_handle("Decode", app_name=SCALED_APP)
    return lambda: handle.stats.remote().result(timeout_s=30)


def _long_answer(oai: openai.OpenAI) -> tuple[list[dict], openai.types.chat.ChatCompletion]:
    """A prompt whose greedy answer runs long (the tiny random model stops at EOS where it likes), and that answer."""
    for i in range(12):
        messages = [{"role": "user", "content": f"Tell me story number {i}, a long one."}]
        calm = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=256, temperature=0, extra_body={"return_token_ids": True}
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


def test_a_stream_survives_the_loss_of_its_decode_replica(scaled_out, decode):
    base, config = scaled_out
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    messages, calm = _long_answer(oai)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=256,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
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
        lambda s: total(s, "ray_prism_migrations_total", application=SCALED_APP, outcome="resumed") >= 1,
    )
    assert total(samples, "ray_prism_migrations_total", application=SCALED_APP, outcome="resumed") >= 1
    # the replacement replica comes up; no decode replica holds KV, and the survivor replayed exactly
    seen: dict[int, dict] = {}
    end = time.time() + 90
    while time.time() < end and len(seen) < 2:
        stats = decode()
        if stats["pid"] != killed:
            seen[int(stats["pid"])] = stats
    assert len(seen) == 2, seen
    assert all(s["kv_blocks_used"] == 0 and s["running"] == 0 for s in seen.values()), seen
    assert sum(s["replayed_tokens"] for s in seen.values()) >= moved["after_tokens"]
    assert all(s["replay_mismatches"] == 0 for s in seen.values()), seen
