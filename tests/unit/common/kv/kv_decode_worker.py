"""Run as a separate OS process by the KV hand-off tests.

* ``decode MODEL CACHE HANDOFF SAMPLING_JSON``: load the model, read a PrefillOutput from wire bytes, decode; prints
  one JSON line ``{"token_ids": [...], "text": "..."}``.
* ``prefill MODEL CACHE OUT SAMPLING_JSON N_IMAGES``: prefill a fixed synthetic request and write the PrefillOutput
  as wire bytes to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.config import ModelConfig
from common.media.synthetic import synthetic_image
from common.model.loader import load_model
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from common.protocol.wire import from_bytes, to_bytes
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt


def fixed_request(lm, n_images: int, sampling: SamplingParams) -> PrefillOutput:
    """The request both processes can build identically."""
    images = [synthetic_image(200 + 40 * i, 160, seed=i) for i in range(n_images)]
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "What do you see?"}]
    media = process_images(lm, images)
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    return prefill(lm, merge(lm, prompt, encode_media(lm, media)), sampling, 16)


def main() -> None:
    mode, model, cache, path, sampling_json = sys.argv[1:6]
    lm = load_model(ModelConfig(model=model, cache_dir=cache))
    sampling = SamplingParams.model_validate_json(sampling_json)
    if mode == "decode":
        out = decode(lm, from_bytes(PrefillOutput, Path(path).read_bytes()), sampling)
        print(json.dumps({"token_ids": list(out.token_ids), "text": out.text}))
    elif mode == "prefill":
        Path(path).write_bytes(to_bytes(fixed_request(lm, int(sys.argv[6]), sampling)))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
