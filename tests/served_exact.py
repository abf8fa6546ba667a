"""The answers of a served application against the reference pipeline (which equals transformers' ``generate()``),
through the official ``openai`` client: LLaVA text and image, Qwen2-VL image and video, greedy, token for token, and
each answer's hand-offs where its model's topology puts them (:func:`tests.served.assert_hops`). The ``make serve``
packages run it in the topologies they deploy."""

from __future__ import annotations

import base64

from common.config import ModelConfig
from common.media.synthetic import synthetic_image, video_bytes
from common.model.loader import LoadedModel, load_model
from common.protocol.handoff import MediaRef
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from tests.mediakit import png_bytes
from tests.reference import media_tokens
from tests.served import assert_hops

LLAVA, QWEN = "prism-tiny-llava", "prism-tiny-qwen2vl"
CASES = [(LLAVA, None), (LLAVA, "image"), (QWEN, "image"), (QWEN, "video")]
IMAGE = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(120, 90, seed=5))).decode()
VIDEO = "data:video/mp4;base64," + base64.b64encode(video_bytes(1.0, fps=10)).decode()
TEXT = "What is there?"
SAMPLING = SamplingParams(max_tokens=10)


def reference_models(model_cache: str) -> dict[str, LoadedModel]:
    return {name: load_model(ModelConfig(model=name, cache_dir=model_cache)) for name in (LLAVA, QWEN)}


def check_answer(client, lm: LoadedModel, model: str, kind: str | None, topology: str) -> None:
    """One case of :data:`CASES` asked through ``client``: the reference's tokens, the topology's hand-offs."""
    if kind is None:
        messages = [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]
        expected = list(run_request(lm, messages, [], SAMPLING).output.token_ids)
        parts: list[dict] = []
    else:
        url = IMAGE if kind == "image" else VIDEO
        expected = media_tokens(lm, MediaRef(kind, url), TEXT, SAMPLING)
        parts = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}}]
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}],
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
        extra_headers={"x-prism-trace": "1"},
    )
    assert answer.choices[0].model_extra["token_ids"] == expected, (model, kind, topology)
    assert_hops(answer.model_extra["prism_trace"], topology, media=kind is not None)
