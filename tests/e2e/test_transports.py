"""The object-store and NIXL transports give identical tokens through the whole deployed pipeline."""

from __future__ import annotations

import base64
import io

import openai

from common.media.synthetic import synthetic_image
from tests.e2e.conftest import API_KEY
from tests.e2e.prometheus import total, wait_for


def _ask(base: str, content) -> tuple[list[int], list[int]]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="prism-tiny-llava",
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]


def test_nixl_and_object_store_give_identical_tokens(prism_server, nixl_base):
    base, config = prism_server
    buf = io.BytesIO()
    synthetic_image(240, 180, seed=11).save(buf, "PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }
    for content in ("Count to five.", [image, {"type": "text", "text": "Describe it."}]):
        via_store = _ask(base, content)
        via_nixl = _ask(nixl_base, content)
        assert via_nixl == via_store
        assert len(via_store[1]) == 16
    from ray import serve

    nixl_stats = serve.get_deployment_handle("Decode", app_name="prism-nixl").stats.remote().result(timeout_s=30)
    store_stats = serve.get_deployment_handle("Decode", app_name="prism").stats.remote().result(timeout_s=30)
    assert (nixl_stats["transport"], nixl_stats["fetches"]) == ("nixl", 2), "the NIXL app must read its KV over NIXL"
    assert store_stats["transport"] == "object_store"
    # the hand-offs are metered per backend: the NIXL app's KV went over nixl, the other's through the object store
    nixl_kv = {"application": "prism-nixl", "backend": "nixl", "payload": "kv"}
    samples = wait_for(config["_metrics_url"], lambda s: total(s, "ray_prism_transfer_seconds_count", **nixl_kv) >= 2)
    assert total(samples, "ray_prism_transfer_seconds_count", **nixl_kv) == 2
    assert total(samples, "ray_prism_transfer_bytes_total", **nixl_kv) > 0
    assert total(samples, "ray_prism_transfer_bytes_total", application="prism-nixl", backend="object_store") > 0
