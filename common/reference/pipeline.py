"""All stages chained in one process on the reference prefill and decode.

``run_request`` does what the disaggregated deployments do, stage by stage, through the same hand-off objects, but
one unbatched, unchunked sequence at a time, and records each stage's wall time. Tests compare it with
``model.generate()``; the CLI demo prints its timings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from common.config import EngineConfig
from common.model.loader import LoadedModel
from common.protocol.sampling import SamplingParams
from common.reference.decode import DecodeResult, decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt


@dataclass
class StageTimings:
    """Seconds spent per stage for one request."""

    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, stage: str, start: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class RequestResult:
    prompt_token_ids: tuple[int, ...]
    output: DecodeResult
    timings: StageTimings


def run_request(
    lm: LoadedModel,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image],
    sampling: SamplingParams,
    engine: EngineConfig | None = None,
) -> RequestResult:
    engine = engine or EngineConfig()
    sampling = sampling.resolved()
    if sampling.max_tokens > engine.max_output_tokens:
        sampling = sampling.model_copy(update={"max_tokens": engine.max_output_tokens})
    t = StageTimings()
    start = time.perf_counter()
    media = process_images(lm, images)
    t.record("process", start)
    start = time.perf_counter()
    prompt = build_prompt(lm, messages, media, engine.max_prompt_tokens)
    t.record("prompt", start)
    start = time.perf_counter()
    embeddings = encode_media(lm, media)
    t.record("encode", start)
    start = time.perf_counter()
    merged = merge(lm, prompt, embeddings)
    t.record("merge", start)
    start = time.perf_counter()
    pre = prefill(lm, merged, sampling, engine.kv_block_size)
    t.record("prefill", start)
    start = time.perf_counter()
    out = decode(lm, pre, sampling)
    t.record("decode", start)
    return RequestResult(prompt_token_ids=tuple(int(i) for i in prompt.token_ids), output=out, timings=t)
