"""LLaVA-1.5 family: CLIP vision tower → 2-layer MLP projector → Llama LM, fixed square patch grid.

Every image is resized/cropped to the tower's fixed ``image_size``, so each one becomes the same number of
placeholder tokens (``(image_size / patch_size)²``, minus nothing: the CLS token is dropped by the "default" feature
selection strategy, kept by "full"). Positions are plain 1-D RoPE, so decode needs no rope delta.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from common.model.families.base import FamilyAdapter, PresetDims, ProcessedPixels
from common.model.families.tool_format import ASSISTANT_CALLS, TOOL_RESPONSE, TOOLS_BLOCK
from common.protocol.handoff import Modality, ProcessedMedia

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{{- '<image>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
# LLaVA-1.5's checkpoints have no tool format; the built model takes tool_format's (the Qwen2.5 / Hermes one): with
# tools, a SYSTEM turn first carries their definitions (after the client's system text); tool messages are USER turns
# of <tool_response> blocks, consecutive ones sharing a turn.
_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- 'SYSTEM: ' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}"
    + _CONTENT
    + "{%- endif -%}"
    + TOOLS_BLOCK
    + "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}"
    "{%- if not loop.first or tools -%}{{- ' ' -}}{%- endif -%}{{- 'USER:' -}}{%- endif -%}"
    + TOOL_RESPONSE
    + "{%- else -%}"
    "{%- if not loop.first or tools -%}{{- ' ' -}}{%- endif -%}"
    "{{- message['role'] | upper -}}{{- ': ' -}}"
    + _CONTENT
    + ASSISTANT_CALLS
    + "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ' ASSISTANT:' -}}{%- endif -%}"
)


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    model_types = ("llava",)
    model_class = LlavaForConditionalGeneration
    modalities = ("image",)
    # Checkpoints on disk (llava-hf's and what transformers 5 itself saves) use the bare names; the ``model.``
    # forms are the in-memory module paths, accepted in case a checkpoint was saved with them.
    vision_prefixes = ("model.vision_tower.", "vision_tower.")
    projector_prefixes = ("model.multi_modal_projector.", "multi_modal_projector.")
    allows_span_split = True  # causal LM over the visual embeddings: a prefix hit or a chunk may end mid-image

    def placeholder_token(self, modality: Modality) -> str:
        if modality != "image":
            raise ValueError("LLaVA-1.5 takes images only")
        return "<image>"

    def placeholder_token_id(self, config: Any, tokenizer: Any, modality: Modality) -> int:
        self.placeholder_token(modality)
        return int(config.image_token_id)

    def load_image_processor(self, model_dir: str) -> Any:
        return AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def process_image(self, image_processor: Any, config: Any, image: Image.Image) -> ProcessedPixels:
        out = image_processor(images=[image], return_tensors="np")
        pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        patch = int(config.vision_config.patch_size)
        grid = (1, pixels.shape[1] // patch, pixels.shape[2] // patch)
        tokens = grid[1] * grid[2] + (1 if config.vision_feature_select_strategy == "full" else 0)
        return ProcessedPixels(pixel_values=pixels, grid_thw=grid, num_visual_tokens=tokens)

    def encode(self, model: Any, items: list[ProcessedMedia]) -> list[torch.Tensor]:
        dtype = model.model.vision_tower.dtype
        pixels = torch.from_numpy(np.stack([m.pixel_values for m in items])).to(dtype)
        out = model.model.get_image_features(pixel_values=pixels, return_dict=True)
        return list(out.pooler_output)

    # ---- builder ------------------------------------------------------------------------------------------
    def special_tokens(self) -> list[str]:
        return ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

    def tokenizer_kwargs(self) -> dict[str, str]:
        return {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

    def chat_template(self) -> str:
        return _CHAT_TEMPLATE

    def build_config(self, dims: PresetDims, tokenizer: Any, dtype: str) -> Any:
        vision = CLIPVisionConfig(
            hidden_size=dims.vision_hidden,
            intermediate_size=dims.vision_hidden * 4,
            num_hidden_layers=dims.vision_layers,
            num_attention_heads=dims.vision_heads,
            image_size=dims.image_size,
            patch_size=dims.patch_size,
            projection_dim=dims.vision_hidden,
            initializer_range=dims.initializer_range,
            initializer_factor=dims.initializer_range / 0.02,
        )
        text = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=dims.lm_hidden,
            intermediate_size=dims.lm_intermediate,
            num_hidden_layers=dims.lm_layers,
            num_attention_heads=dims.lm_heads,
            num_key_value_heads=dims.lm_kv_heads,
            max_position_embeddings=4096,
            initializer_range=dims.initializer_range,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        grid = dims.image_size // dims.patch_size
        return LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            image_seq_length=grid * grid,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            dtype=dtype,
        )

    def build_image_processor(self, dims: PresetDims) -> Any:
        side = dims.image_size
        return CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}, do_center_crop=True
        )

    def save_processor(self, out: Path, dims: PresetDims, tokenizer: Any, config: Any) -> None:
        """``processor_config.json`` as llava-hf checkpoints have it (patch size, feature-select strategy, CLIP's
        extra CLS token), so ``AutoProcessor.from_pretrained`` gives a working ``LlavaProcessor``; and the image
        processor's own ``preprocessor_config.json``, which transformers 5 folds into the former."""
        image = self.build_image_processor(dims)
        image.save_pretrained(out)
        LlavaProcessor(
            image_processor=image,
            tokenizer=tokenizer,
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=1,
            chat_template=tokenizer.chat_template,
        ).save_pretrained(out)
