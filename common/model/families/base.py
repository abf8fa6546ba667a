"""The contract every model family implements.

A family is one transformers architecture (LLaVA-1.5, Qwen2-VL, ...). Prism's stages never branch on the family;
they call the adapter, and the adapter knows the architecture's quirks: how its processor lays out pixels, how many
placeholder tokens an image becomes, which submodules are the vision tower and the projector, and how positions
are computed (1-D RoPE vs Qwen2-VL's M-RoPE with its ``rope_delta``).

Adapters are stateless singletons registered in :mod:`common.model.registry` under the ``model_type`` values of
``config.json`` they accept. The builder half (``build_config`` etc.) creates the embedded tiny/small models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from common.protocol.handoff import Modality, PlaceholderSpan, ProcessedMedia
from common.tools.tags import TOOL_MARKERS


@dataclass(frozen=True)
class PresetDims:
    """Sizes of one embedded model preset; families read the fields they need."""

    vision_hidden: int
    vision_layers: int
    vision_heads: int
    lm_hidden: int
    lm_layers: int
    lm_heads: int
    lm_kv_heads: int
    lm_intermediate: int
    image_size: int
    """LLaVA: fixed input side. Qwen2-VL: side of the largest square image kept at full resolution."""
    patch_size: int
    vocab_size: int
    initializer_range: float


@dataclass(frozen=True)
class ProcessedPixels:
    """What a family's processor makes of one image, before it gets an index and a digest."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_visual_tokens: int


class FamilyAdapter(ABC):
    """Architecture-specific behaviour behind a family-agnostic interface."""

    name: str
    model_types: tuple[str, ...]
    model_class: type
    modalities: tuple[Modality, ...]
    """Media kinds the architecture takes; each has its own placeholder token."""
    vision_prefixes: tuple[str, ...]
    """safetensors key prefixes of the vision tower (current and legacy checkpoint layouts)."""
    projector_prefixes: tuple[str, ...]
    """safetensors key prefixes of the projector/merger; checked before ``vision_prefixes``."""
    tool_markers: tuple[str, ...] = TOOL_MARKERS
    """Tokens the builder adds for the tool-call format of the embedded models' templates
    (:mod:`common.model.families.tool_format`)."""
    allows_span_split: bool = False
    """Whether prefill may cut one media item's placeholder span: a chunk may end inside it, and a prefix-cache hit
    may end inside it (the rest of the span is computed from its embeddings, which the prefill stage holds whole).
    A family opts in when its language model attends over visual embeddings as ordinary causal positions (LLaVA,
    Qwen2-VL — M-RoPE positions are computed for the whole prompt before any chunk); the default keeps spans whole,
    which families with bidirectional attention inside an image (Gemma-3 style) need: their image tokens' KV
    depends on the tokens after them in the same span."""

    # ---- tokens and prompts -------------------------------------------------------------------------------
    @abstractmethod
    def placeholder_token(self, modality: Modality) -> str:
        """The special token the chat template emits once per media item and the prompt expands N times."""

    def placeholder_token_id(self, config: Any, tokenizer: Any, modality: Modality) -> int:
        return int(tokenizer.convert_tokens_to_ids(self.placeholder_token(modality)))

    # ---- processing ---------------------------------------------------------------------------------------
    @abstractmethod
    def load_image_processor(self, model_dir: str) -> Any:
        """The family's PIL-backend image processor from the model directory (no torchvision here)."""

    @abstractmethod
    def process_image(self, image_processor: Any, config: Any, image: Image.Image) -> ProcessedPixels:
        """One RGB image → pixel array in the family layout + patch grid + visual-token count."""

    def load_video_bounds(self, model_dir: str, image_processor: Any) -> tuple[int, int] | None:
        """The checkpoint's own pixel bounds for video frames (``min_pixels``, ``max_pixels``), where they differ from
        the image processor's; ``None``: the image processor's (or no video). A checkpoint whose video settings the
        family's video path cannot honour is refused here, at load."""
        return None

    def process_video(
        self, image_processor: Any, config: Any, frames: list[Image.Image], bounds: tuple[int, int] | None = None
    ) -> ProcessedPixels:
        """Sampled RGB frames → one video item, each frame resized within ``bounds`` (:meth:`load_video_bounds`;
        ``None``: the image processor's); families without video refuse (the prompt stage has already refused video
        for them, so this is a second line)."""
        raise NotImplementedError(f"{self.name} does not take video input")

    # ---- encoding -----------------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, model: Any, items: list[ProcessedMedia]) -> list[torch.Tensor]:
        """Vision tower + projector over ``items`` (one call); one ``[tokens, lm_hidden]`` tensor per item."""

    # ---- language model -----------------------------------------------------------------------------------
    def language_model(self, model: Any) -> Any:
        return model.model.language_model

    def prefill_positions(
        self, model: Any, token_ids: torch.Tensor, spans: tuple[PlaceholderSpan, ...]
    ) -> tuple[torch.Tensor | None, int]:
        """Position ids for the prompt (``None`` = the model's default 1-D positions) and the rope delta."""
        return None, 0

    def decode_positions(self, past_lens: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """Position ids for one new token per sequence, after ``past_lens[i]`` cached tokens (``[B]`` each)."""
        return past_lens.view(-1, 1)

    # ---- builder ------------------------------------------------------------------------------------------
    @abstractmethod
    def special_tokens(self) -> list[str]:
        """Special tokens of the embedded tokenizer, in id order (id 0 first)."""

    @abstractmethod
    def tokenizer_kwargs(self) -> dict[str, str]:
        """bos/eos/pad/unk token strings for the tokenizer wrapper."""

    @abstractmethod
    def chat_template(self) -> str:
        """Jinja chat template of the embedded model (same conventions as the family's public checkpoints)."""

    @abstractmethod
    def build_config(self, dims: PresetDims, tokenizer: Any, dtype: str) -> Any:
        """A transformers config for an embedded model of this family."""

    @abstractmethod
    def build_image_processor(self, dims: PresetDims) -> Any:
        """The PIL image processor saved next to an embedded model."""

    def save_processor(self, out: Path, dims: PresetDims, tokenizer: Any, config: Any) -> None:
        """Write the processor files a real checkpoint of this family carries (at least ``preprocessor_config.json``),
        so Hugging Face's own loaders find what they expect."""
        self.build_image_processor(dims).save_pretrained(out)
