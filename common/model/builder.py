"""Builds the embedded default models offline, deterministically, as standard HF model directories.

No model hub is reachable, so Prism's default models are tiny random-weight models of real transformers
architectures, built here on first use and cached on disk:

* ``prism-tiny-llava``   — LLaVA-1.5 layout (CLIP tower, MLP projector, Llama LM), 12×12 fixed patch grid.
* ``prism-tiny-qwen2vl`` — Qwen2-VL layout (dynamic resolution, 2×2 merge, M-RoPE).
* ``prism-small-llava`` / ``prism-small-qwen2vl`` — tens of millions of parameters, for benchmarks; they load in
  bfloat16 too.

Each directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``, a trained BPE
``tokenizer.json`` with its ``chat_template``, and the family's processor files (``preprocessor_config.json``;
LLaVA's ``processor_config.json``, Qwen2-VL's ``video_preprocessor_config.json``); plain
``AutoModelForImageTextToText.from_pretrained(dir)`` loads it. The weights use a larger init range than
transformers' default so greedy output is not one repeated token (a degenerate model would hide bugs that reorder or
drop tokens). Same version of this file + same transformers → byte-identical files (the tests check it).

Lifecycle: :func:`resolve_model_dir` is what callers use; it returns a checkpoint directory as-is, or builds the
embedded model into ``cache_dir`` once (under a file lock, into a temp dir renamed into place so concurrent
replicas never see a half-written model).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from common.errors import UnsupportedModelError
from common.model.families.base import FamilyAdapter, PresetDims
from common.model.registry import FAMILIES
from common.model.tokenizer_builder import train_bpe_tokenizer

BUILDER_VERSION = 4
"""Bump when anything here changes the built files: cached builds of the old version are then ignored."""

_SEED = 20261130

_TINY_LM = dict(lm_hidden=64, lm_layers=2, lm_heads=4, lm_kv_heads=2, lm_intermediate=128, initializer_range=0.25)
_SMALL_LM = dict(lm_hidden=512, lm_layers=8, lm_heads=8, lm_kv_heads=4, lm_intermediate=1408, initializer_range=0.1)

PRESETS: dict[str, dict[str, PresetDims]] = {
    "tiny": {
        "llava": PresetDims(
            vision_hidden=32, vision_layers=2, vision_heads=2, image_size=96, patch_size=8, vocab_size=1024, **_TINY_LM
        ),
        "qwen2_vl": PresetDims(
            vision_hidden=32,
            vision_layers=2,
            vision_heads=2,
            image_size=224,
            patch_size=14,
            vocab_size=1024,
            **_TINY_LM,
        ),
    },
    "small": {
        "llava": PresetDims(
            vision_hidden=256,
            vision_layers=4,
            vision_heads=4,
            image_size=224,
            patch_size=14,
            vocab_size=4096,
            **_SMALL_LM,
        ),
        "qwen2_vl": PresetDims(
            vision_hidden=256,
            vision_layers=4,
            vision_heads=4,
            image_size=448,
            patch_size=14,
            vocab_size=4096,
            **_SMALL_LM,
        ),
    },
}


@dataclass(frozen=True)
class EmbeddedModel:
    family: str
    preset: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    f"prism-{preset}-{short}": EmbeddedModel(family, preset)
    for preset in PRESETS
    for family, short in (("llava", "llava"), ("qwen2_vl", "qwen2vl"))
}


def _tokenizer(adapter: FamilyAdapter, dims: PresetDims) -> PreTrainedTokenizerFast:
    tok = train_bpe_tokenizer(adapter.special_tokens(), dims.vocab_size)
    # The tool-call tags: single tokens after the trained vocabulary, plain (not special) so decoded text keeps them.
    tok.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in adapter.tool_markers])
    kwargs = adapter.tokenizer_kwargs()
    if "bos_token" in kwargs:  # Llama-style tokenizers prepend BOS themselves.
        bos = kwargs["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=adapter.chat_template(), **kwargs)


def build_embedded_model(name: str, out_dir: str | Path) -> Path:
    """Write embedded model ``name`` into ``out_dir`` (created; must not hold another model)."""
    if name not in EMBEDDED_MODELS:
        raise UnsupportedModelError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    spec = EMBEDDED_MODELS[name]
    adapter = FAMILIES[spec.family]
    dims = PRESETS[spec.preset][spec.family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()

    tokenizer = _tokenizer(adapter, dims)
    config = adapter.build_config(dims, tokenizer, dtype="float32")
    config.name_or_path = name
    torch.manual_seed(_SEED)
    model = adapter.model_class(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    adapter.save_processor(out, dims, tokenizer, config)
    return out


def resolve_model_dir(model: str, cache_dir: str | Path) -> Path:
    """A local HF checkpoint directory as-is, or the embedded model ``model`` built into ``cache_dir`` once."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if model not in EMBEDDED_MODELS:
        raise UnsupportedModelError(
            f"model {model!r} is neither a local model directory nor an embedded model ({sorted(EMBEDDED_MODELS)})"
        )
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{model}-v{BUILDER_VERSION}"
    if (target / "config.json").exists():
        return target
    with open(cache / f".{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others find it built when they get the lock
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{model}-", dir=cache))
            try:
                build_embedded_model(model, tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
