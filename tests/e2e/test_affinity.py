"""Cache reach end to end: with 2 encode and 2 prefill replicas, the affinity routers send a repeated image to the
encode replica that holds its embeddings and a prompt that starts like an earlier one to the prefill replica that
holds its KV blocks, while a mix of distinct images spreads over both (the shared cluster's scaled-out application,
:func:`tests.e2e.conftest.scaled_out`)."""

from __future__ import annotations

import base64
import random
from collections import Counter

import httpx
import pytest

from common.media.synthetic import synthetic_image
from tests.e2e.conftest import API_KEY, SCALED_APP
from tests.e2e.prometheus import total, wait_for
from tests.mediakit import jpeg_bytes

APP = SCALED_APP
MODEL = "prism-tiny-llava"
VISUAL_TOKENS = 144  # the tiny LLaVA's 12 × 12 patch grid: 9 KV blocks of 16


@pytest.fixture(scope="module")
def affinity(scaled_out):
    base, config = scaled_out
    with httpx.Client(timeout=60) as http:
        yield base, http, config


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
    label = {"application": APP, "stage": "encode", "outcome": "new"}
    samples = wait_for(config["_metrics_url"], lambda s: total(s, "ray_prism_route_affinity_total", **label) >= 32)
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
