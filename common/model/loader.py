"""Loads a model directory of any registered family: the front end alone, or front end + weights.

Lifecycle: :func:`load_frontend` resolves the directory (building an embedded model on first use), picks the family
adapter from ``config.json`` and loads what request handling needs without weights — config, tokenizer, PIL image
processor, chat template, generation settings — and hashes the directory into a :class:`ModelContract`. The media
stage and the ingress stop there. :func:`load_model` adds the weights (the encode, prefill and decode stages) and,
on the CPU, packs the linear layers' weights for oneDNN (:mod:`common.model.linear`). Both
results are read-only afterwards and shared by every stage in the process; stages run under
``torch.inference_mode()``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from common.config import ModelConfig
from common.errors import UnsupportedModelError
from common.model.builder import resolve_model_dir
from common.model.contract import ModelContract, build_contract
from common.model.families.base import FamilyAdapter
from common.model.linear import pack_linears
from common.model.registry import family_for_dir
from common.model.token_bytes import TokenBytes
from common.protocol.handoff import Modality

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelFrontend:
    """Everything about a model except its weights: enough to parse, process and tokenize requests."""

    adapter: FamilyAdapter
    config: Any
    tokenizer: Any
    image_processor: Any
    contract: ModelContract
    model_dir: Path
    served_name: str
    eos_token_ids: frozenset[int]
    video_bounds: tuple[int, int] | None = field(default=None, kw_only=True)
    """Pixel bounds for video frames from the checkpoint's video processor config (``None``: the image
    processor's): :meth:`FamilyAdapter.load_video_bounds`."""

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config()

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the language model's KV cache."""
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return int(tc.num_hidden_layers), int(tc.num_key_value_heads), int(head_dim)

    def placeholder_id(self, modality: Modality) -> int:
        return self.adapter.placeholder_token_id(self.config, self.tokenizer, modality)

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's bytes (what ``logprobs`` report)."""
        return TokenBytes(self.tokenizer)

    @functools.cached_property
    def small_image_tokens(self) -> int:
        """Visual tokens of a tiny (28×28) image: what the ingress reserves decode KV for, per image, before the
        media stage knows the real count — exact for a fixed-resolution family (LLaVA), about the smallest count for
        Qwen2-VL (its processor scales small images up to ``min_pixels``). An estimate only: the decode stage resizes
        the reservation to the prefilled KV."""
        from PIL import Image

        tiny = Image.new("RGB", (28, 28))
        return int(self.adapter.process_image(self.image_processor, self.config, tiny).num_visual_tokens)


@dataclass(frozen=True)
class LoadedModel(ModelFrontend):
    """A front end plus weights; ``config`` is the model's own (live) config object."""

    model: Any

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def _eos_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources: list[Any] = [tokenizer.eos_token_id]
    if (model_dir / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for src in sources:
        if src is not None:
            ids.update(src if isinstance(src, (list, tuple)) else [src])
    return frozenset(int(i) for i in ids)


def load_frontend(cfg: ModelConfig, config: Any = None, dtype: str | None = None) -> ModelFrontend:
    """Load (building if needed) everything but the weights of the model ``cfg`` names."""
    hf_logging.disable_progress_bar()  # per-shard bars are noise in replica logs
    model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
    adapter = family_for_dir(model_dir)
    config = config if config is not None else AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise UnsupportedModelError(f"{model_dir} has no chat template")
    image_processor = adapter.load_image_processor(str(model_dir))
    served = cfg.name
    if dtype is None:
        dtype = cfg.dtype if cfg.dtype != "auto" else str(getattr(config, "dtype", None) or "float32")
    contract = build_contract(
        model_id=served,
        model_dir=model_dir,
        adapter=adapter,
        chat_template=tokenizer.chat_template,
        processor_class=type(image_processor).__name__,
        dtype=dtype.removeprefix("torch."),
        cache_dir=Path(cfg.cache_dir).expanduser(),
    )
    return ModelFrontend(
        adapter=adapter,
        config=config,
        tokenizer=tokenizer,
        image_processor=image_processor,
        contract=contract,
        model_dir=model_dir,
        served_name=served,
        eos_token_ids=_eos_ids(model_dir, tokenizer),
        video_bounds=adapter.load_video_bounds(str(model_dir), image_processor),
    )


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load (building if needed) the model ``cfg`` names, weights included."""
    hf_logging.disable_progress_bar()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
    adapter = family_for_dir(model_dir)
    dtype = "auto" if cfg.dtype == "auto" else _DTYPES[cfg.dtype]
    model = adapter.model_class.from_pretrained(model_dir, dtype=dtype).eval()
    model.requires_grad_(False)  # (inference only: no op records a graph, and packed linears keep their fast path)
    if cfg.cpu_linear == "onednn":
        pack_linears(model)
    front = load_frontend(cfg, config=model.config, dtype=str(model.dtype))
    return LoadedModel(**{f: getattr(front, f) for f in front.__dataclass_fields__}, model=model)
