"""Run as a separate OS process by test_kv_handoff: load the model, read a PrefillOutput from wire bytes, decode.

Prints one JSON line: {"token_ids": [...], "text": "..."}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.config import ModelConfig
from common.model.loader import load_model
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from common.protocol.wire import from_bytes
from common.stages.decode import decode


def main() -> None:
    model, cache, handoff, sampling = sys.argv[1:5]
    lm = load_model(ModelConfig(model=model, cache_dir=cache))
    pre = from_bytes(PrefillOutput, Path(handoff).read_bytes())
    out = decode(lm, pre, SamplingParams.model_validate_json(sampling))
    print(json.dumps({"token_ids": list(out.token_ids), "text": out.text}))


if __name__ == "__main__":
    main()
