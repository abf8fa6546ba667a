"""A short MP4 (made with PyAV) through the deployed Qwen2-VL app with the openai client: the token ids equal the
in-process ``common/`` pipeline for the same bytes; the LLaVA app refuses video with a 400."""

from __future__ import annotations

import base64

import openai
import pytest

from common.config import ModelConfig
from common.model.loader import load_model
from common.protocol.handoff import MediaRef
from common.protocol.sampling import SamplingParams
from tests.e2e.conftest import API_KEY
from tests.mediakit import video_bytes
from tests.reference import media_tokens

QWEN = "prism-tiny-qwen2vl"


@pytest.fixture(scope="module")
def qwen_base(prism_server, model_cache):
    from ray import serve

    from common.model.builder import resolve_model_dir
    from services.app import build_app

    resolve_model_dir(QWEN, model_cache)
    base, config = prism_server
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    cfg["model"] = {**config["model"], "model": QWEN}
    serve.run(build_app({"config": cfg}), name="prism-qwen", route_prefix="/qwen")
    yield f"{base}/qwen"
    serve.delete("prism-qwen")


def _reference(url: str, text: str, model_cache: str) -> list[int]:
    lm = load_model(ModelConfig(model=QWEN, cache_dir=model_cache))
    return media_tokens(lm, MediaRef("video", url), text, SamplingParams(max_tokens=12))


def test_short_video_matches_in_process_pipeline(qwen_base, model_cache):
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(2.0, fps=10)).decode()
    client = openai.OpenAI(base_url=f"{qwen_base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    r = client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == _reference(url, "What happens?", model_cache)


def test_llava_app_refuses_video(client):
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(0.5, fps=10)).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="prism-tiny-llava", messages=[{"role": "user", "content": content}])
    assert "does not accept video" in info.value.message
