"""Loads a model directory of any registered family into a :class:`LoadedModel`.

Lifecycle: ``load_model(ModelConfig)`` resolves the directory (building an embedded model on first use), picks the
family adapter from ``config.json``, loads weights with the family's transformers class, the tokenizer, the PIL
image processor and the chat template, and hashes the directory into a :class:`ModelContract`. The result is
read-only afterwards and shared by every stage in the process; stages run under ``torch.inference_mode()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from common.config import ModelConfig
from common.errors import UnsupportedModelError
from common.model.builder import resolve_model_dir
from common.model.contract import ModelContract, build_contract
from common.model.families.base import FamilyAdapter
from common.model.registry import family_for_dir
from common.protocol.handoff import Modality

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the stages: weights, tokenizer, processor, adapter and contract."""

    adapter: FamilyAdapter
    model: Any
    tokenizer: Any
    image_processor: Any
    contract: ModelContract
    model_dir: Path
    served_name: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        return self.model.config.get_text_config()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the language model's KV cache."""
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        return int(tc.num_hidden_layers), int(tc.num_key_value_heads), int(head_dim)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return frozenset(int(i) for i in ids)

    def placeholder_id(self, modality: Modality) -> int:
        return self.adapter.placeholder_token_id(self.config, self.tokenizer, modality)


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load (building if needed) the model ``cfg`` names."""
    hf_logging.disable_progress_bar()  # per-shard bars are noise in replica logs
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
    adapter = family_for_dir(model_dir)
    dtype = "auto" if cfg.dtype == "auto" else _DTYPES[cfg.dtype]
    model = adapter.model_class.from_pretrained(model_dir, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise UnsupportedModelError(f"{model_dir} has no chat template")
    image_processor = adapter.load_image_processor(str(model_dir))
    served = cfg.served_name or (cfg.model if not Path(cfg.model).expanduser().is_dir() else model_dir.name)
    contract = build_contract(
        model_id=served,
        model_dir=model_dir,
        adapter=adapter,
        chat_template=tokenizer.chat_template,
        processor_class=type(image_processor).__name__,
        dtype=str(model.dtype).removeprefix("torch."),
    )
    return LoadedModel(
        adapter=adapter,
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        contract=contract,
        model_dir=model_dir,
        served_name=served,
    )
