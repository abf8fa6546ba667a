"""The reference answer for one media item (a video clip, an image): every ``common/`` stage chained in this process,
greedy.

The deployed Qwen2-VL app is checked token for token against it (``tests/e2e/test_video.py``; over NIXL:
``tests/e2e/test_transports.py``), and so is the offline batch job (``tests/batch``).
"""

from __future__ import annotations

from common.config.media import MediaConfig
from common.media.fetch import MediaFetcher
from common.media.loader import load_media
from common.model.loader import LoadedModel
from common.protocol.handoff import MediaRef
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_loaded
from common.stages.prompt import build_prompt


def media_tokens(
    lm: LoadedModel,
    ref: MediaRef,
    text: str,
    sampling: SamplingParams,
    media_cfg: MediaConfig | None = None,
    max_prompt_tokens: int = 8192,
    block_size: int = 16,
) -> list[int]:
    """Token ids the model generates for ``text`` about ``ref`` (fetched, and a clip sampled, under ``media_cfg``)."""
    cfg = media_cfg or MediaConfig()
    media = process_loaded(lm, load_media([ref], cfg, MediaFetcher(cfg)))
    content = [{"type": ref.kind}, {"type": "text", "text": text}]
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, max_prompt_tokens)
    pre = prefill(lm, merge(lm, prompt, encode_media(lm, media)), sampling, block_size)
    return list(decode(lm, pre, sampling).token_ids)
