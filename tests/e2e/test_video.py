"""A short MP4 (made with PyAV) through the deployed Qwen2-VL app with the openai client: the token ids equal the
in-process ``common/`` pipeline for the same bytes; the LLaVA app refuses video with a 400."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from common.config import ModelConfig
from common.config.media import MediaConfig
from common.media.fetch import MediaFetcher
from common.media.loader import load_media
from common.model.builder import resolve_model_dir
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

    # The visual tokens are what the checkpoint's video processor config implies (its own pixel bounds, read from the
    # file here), not the image processor's.
    model_dir = resolve_model_dir(QWEN, model_cache)
    saved = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    cfg = MediaConfig()
    frames = load_media([MediaRef("video", url)], cfg, MediaFetcher(cfg))[0].frames
    factor = saved["patch_size"] * saved["merge_size"]
    h, w = smart_resize(frames[0].height, frames[0].width, factor, saved["min_pixels"], saved["max_pixels"])
    expected = -(-len(frames) // saved["temporal_patch_size"]) * (h // factor) * (w // factor)
    pad = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|video_pad|>")
    assert r.model_extra["prompt_token_ids"].count(pad) == expected


def test_llava_app_refuses_video(client):
    url = "data:video/mp4;base64," + base64.b64encode(video_bytes(0.5, fps=10)).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="prism-tiny-llava", messages=[{"role": "user", "content": content}])
    assert "does not accept video" in info.value.message
