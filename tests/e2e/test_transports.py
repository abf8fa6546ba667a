"""The object-store and NIXL transports give identical tokens through the whole deployed pipeline: visual embeddings
(encode → prefill) and KV (prefill → decode) both over NIXL, for both model families — LLaVA against the
object-store application, Qwen2-VL against the in-process reference."""

from __future__ import annotations

import base64
import io

import openai

from common.config import ModelConfig
from common.media.synthetic import synthetic_image
from common.model.loader import load_model
from common.protocol.handoff import MediaRef
from common.protocol.sampling import SamplingParams
from tests.e2e.conftest import API_KEY, QWEN
from tests.e2e.prometheus import total, wait_for
from tests.reference import media_tokens

LLAVA = "prism-tiny-llava"


def _ask(base: str, content, model: str = LLAVA) -> tuple[list[int], list[int]]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]


def _image_url() -> str:
    buf = io.BytesIO()
    synthetic_image(240, 180, seed=11).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _stats(app: str, deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=30)


def test_nixl_and_object_store_give_identical_tokens(prism_server, nixl_base, model_cache):
    base, config = prism_server
    image = {"type": "image_url", "image_url": {"url": _image_url()}}
    for content in ("Count to five.", [image, {"type": "text", "text": "Describe it."}]):
        via_store = _ask(base, content)
        via_nixl = _ask(nixl_base, content)
        assert via_nixl == via_store
        assert len(via_store[1]) == 16
    qwen = load_model(ModelConfig(model=QWEN, cache_dir=model_cache))
    want = media_tokens(qwen, MediaRef("image", _image_url()), "Describe it.", SamplingParams(max_tokens=16))
    assert _ask(nixl_base, [image, {"type": "text", "text": "Describe it."}], QWEN)[1] == want

    nixl_stats = _stats("prism-nixl", f"Decode-{LLAVA}")
    assert (nixl_stats["transport"], nixl_stats["fetches"]) == ("nixl", 2), "the NIXL app must read its KV over NIXL"
    assert _stats("prism-nixl", f"Decode-{QWEN}")["transport"] == "nixl", "a model's own transport"
    assert _stats("prism", "Decode")["transport"] == "object_store"
    # the hand-offs are metered per backend: the NIXL app's embeddings and KV went over nixl (pixels, media → encode,
    # through the object store), the other app's through the object store
    nixl_app = {"application": "prism-nixl", "backend": "nixl"}

    def arrived(s) -> bool:
        return (
            total(s, "ray_prism_transfer_seconds_count", payload="kv", **nixl_app) >= 3
            and total(s, "ray_prism_transfer_seconds_count", payload="embeddings", **nixl_app) >= 2
            and total(s, "ray_prism_transfer_bytes_total", application="prism-nixl", payload="pixels") > 0
        )

    samples = wait_for(config["_metrics_url"], arrived)
    assert total(samples, "ray_prism_transfer_seconds_count", payload="kv", **nixl_app) == 3
    assert total(samples, "ray_prism_transfer_seconds_count", payload="embeddings", **nixl_app) == 2
    assert total(samples, "ray_prism_transfer_bytes_total", payload="embeddings", **nixl_app) > 0
    store_embeddings = {"application": "prism-nixl", "backend": "object_store", "payload": "embeddings"}
    assert total(samples, "ray_prism_transfer_bytes_total", **store_embeddings) == 0
