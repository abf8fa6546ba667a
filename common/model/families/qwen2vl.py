"""Qwen2-VL family: dynamic-resolution ViT with 2×2 patch merge → Qwen2 LM with M-RoPE.

Images keep (roughly) their aspect ratio: the processor resizes each side to a multiple of
``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, so the number of placeholder tokens varies per
image (``t * h * w / merge²``). Text and visual tokens get 3-D (temporal, height, width) rotary positions; after the
prompt, positions continue from ``max(position) + 1`` rather than the token count, and the difference is the
``rope_delta`` that decode must add to every cache position. Prefill computes it with the model's own
``get_rope_index`` (so it tracks transformers exactly) and hands it to decode in :class:`PrefillOutput`.

``Qwen2VLProcessor`` needs torchvision (its video processor), which this platform cannot install; Prism expands
``<|image_pad|>`` itself from the span map, which is all the processor would have done for text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from common.errors import UnsupportedModelError
from common.model.families.base import FamilyAdapter, PresetDims, ProcessedPixels
from common.model.families.tool_format import ASSISTANT_CALLS, TOOL_RESPONSE, TOOLS_BLOCK
from common.protocol.handoff import Modality, PlaceholderSpan, ProcessedMedia

_MODALITY_TYPE = {"image": 1, "video": 2}

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_DEFAULT_SYSTEM = "You are a helpful assistant."
# With tools, the system turn carries their definitions (after the client's system text, or the default one); tool
# messages are user turns of <tool_response> blocks, consecutive ones sharing a turn (see tool_format).
_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}" + _CONTENT + "{%- else -%}"
    "{{- '" + _DEFAULT_SYSTEM + "' -}}{%- endif -%}" + TOOLS_BLOCK + "{{- '<|im_end|>\\n' -}}"
    "{%- elif messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + _DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    + TOOL_RESPONSE
    + "{%- if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + ASSISTANT_CALLS + "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class Qwen2VLAdapter(FamilyAdapter):
    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    model_class = Qwen2VLForConditionalGeneration
    modalities = ("image", "video")
    # On-disk names first (``visual.``), then the in-memory module path form.
    vision_prefixes = ("visual.", "model.visual.")
    projector_prefixes = ("visual.merger.", "model.visual.merger.")
    allows_span_split = True  # causal LM over the visual embeddings: a prefix hit or a chunk may end mid-image

    def placeholder_token(self, modality: Modality) -> str:
        return "<|image_pad|>" if modality == "image" else "<|video_pad|>"

    def placeholder_token_id(self, config: Any, tokenizer: Any, modality: Modality) -> int:
        return int(config.image_token_id if modality == "image" else config.video_token_id)

    def load_image_processor(self, model_dir: str) -> Any:
        return AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def process_image(self, image_processor: Any, config: Any, image: Image.Image) -> ProcessedPixels:
        out = image_processor(images=[image], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        merge = int(config.vision_config.spatial_merge_size)
        tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return ProcessedPixels(pixel_values=pixels, grid_thw=grid, num_visual_tokens=tokens)

    def load_video_bounds(self, model_dir: str, image_processor: Any) -> tuple[int, int] | None:
        """``video_preprocessor_config.json``'s pixel bounds (``min_pixels`` / ``max_pixels``, else
        ``size.shortest_edge`` / ``size.longest_edge`` as transformers 5 saves them): what ``Qwen2VLVideoProcessor``
        resizes frames within — real checkpoints give video a smaller ``max_pixels`` than images. No file:
        transformers' video processor reads ``preprocessor_config.json`` (the image bounds). Refused: a file without
        bounds (the video processor's class defaults would apply, which this path does not reproduce) or whose patch,
        merge or temporal sizes differ from the image processor's (the path cuts patches with the image processor's).
        """
        path = Path(model_dir) / "video_preprocessor_config.json"
        if not path.exists():
            return None
        try:
            cfg = json.loads(path.read_text())
        except ValueError:
            raise UnsupportedModelError(f"{path} is not JSON") from None
        size = cfg.get("size") if isinstance(cfg, dict) else None
        if not isinstance(cfg, dict) or not isinstance(size or {}, dict):
            raise UnsupportedModelError(f"{path} is not a video processor config")
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            if key in cfg and cfg[key] != getattr(image_processor, key):
                raise UnsupportedModelError(f"{path}: {key} {cfg[key]} differs from the image processor's")
        # (top-level min_pixels / max_pixels override size, as in transformers' Qwen2VLVideoProcessor)
        size = size or {}
        low, high = cfg.get("min_pixels", size.get("shortest_edge")), cfg.get("max_pixels", size.get("longest_edge"))
        if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
            raise UnsupportedModelError(f"{path} gives no usable pixel bounds (size.shortest_edge/longest_edge)")
        return low, high

    def process_video(
        self, image_processor: Any, config: Any, frames: list[Image.Image], bounds: tuple[int, int] | None = None
    ) -> ProcessedPixels:
        """Sampled RGB frames → temporal patches, the layout ``Qwen2VLVideoProcessor`` produces (which needs
        torchvision, unavailable here): frames resized to one grid within the video's pixel ``bounds`` (the image
        processor's when ``None``), rescaled and normalized, padded to a multiple of ``temporal_patch_size`` by
        repeating the last frame, then cut into ``(t, h, w)`` patches of ``C × temporal × patch × patch`` values."""
        ps, merge, tp = image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size
        size = image_processor.size
        low, high = bounds or (size.shortest_edge, size.longest_edge)
        height, width = smart_resize(frames[0].height, frames[0].width, ps * merge, low, high)
        mean = np.asarray(image_processor.image_mean, np.float32)[:, None, None]
        std = np.asarray(image_processor.image_std, np.float32)[:, None, None]
        scale = np.float32(image_processor.rescale_factor)
        arrays = [
            (
                np.asarray(f.convert("RGB").resize((width, height), Image.BICUBIC), np.float32).transpose(2, 0, 1)
                * scale
                - mean
            )
            / std
            for f in frames
        ]
        arrays += [arrays[-1]] * (-len(arrays) % tp)
        video = np.stack(arrays)  # [T, C, H, W]
        t, c = video.shape[0] // tp, video.shape[1]
        gh, gw = height // ps, width // ps
        patches = video.reshape(t, tp, c, gh // merge, merge, ps, gw // merge, merge, ps)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, c * tp * ps * ps)
        grid = (t, gh, gw)
        return ProcessedPixels(np.ascontiguousarray(patches, np.float32), grid, t * gh * gw // (merge * merge))

    def encode(self, model: Any, items: list[ProcessedMedia]) -> list[torch.Tensor]:
        """One tower call per modality present, results returned in the items' order."""
        dtype = model.model.visual.dtype
        out: dict[int, torch.Tensor] = {}
        for modality in ("image", "video"):
            group = [i for i, m in enumerate(items) if m.modality == modality]
            if not group:
                continue
            pixels = torch.from_numpy(np.concatenate([items[i].pixel_values for i in group])).to(dtype)
            grid = torch.tensor([items[i].grid_thw for i in group], dtype=torch.long)
            if modality == "image":
                res = model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True)
            else:
                res = model.model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid, return_dict=True)
            out.update(zip(group, res.pooler_output, strict=True))
        return [out[i] for i in range(len(items))]

    def prefill_positions(
        self, model: Any, token_ids: torch.Tensor, spans: tuple[PlaceholderSpan, ...]
    ) -> tuple[torch.Tensor | None, int]:
        if not spans:
            return None, 0
        types = torch.zeros_like(token_ids)
        for s in spans:
            types[s.prompt_token_start : s.end] = _MODALITY_TYPE[s.modality]
        images = [s.grid_thw for s in spans if s.modality == "image"]
        videos = [s.grid_thw for s in spans if s.modality == "video"]
        positions, deltas = model.model.get_rope_index(
            token_ids[None],
            mm_token_type_ids=types[None],
            image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
            video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
        )
        return positions, int(deltas.reshape(-1)[0])

    def decode_positions(self, past_lens: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        pos = (past_lens + rope_deltas).view(1, -1, 1)
        return pos.expand(3, -1, 1)

    # ---- builder ------------------------------------------------------------------------------------------
    def special_tokens(self) -> list[str]:
        return [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ]

    def tokenizer_kwargs(self) -> dict[str, str]:
        return {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}

    def chat_template(self) -> str:
        return _CHAT_TEMPLATE

    def build_config(self, dims: PresetDims, tokenizer: Any, dtype: str) -> Any:
        head_dim = dims.lm_hidden // dims.lm_heads
        half = head_dim // 2
        # M-RoPE splits the rotary half-dimension into (temporal, height, width) sections, Qwen's 1:1.5:1.5.
        t = half // 4
        h = (half - t) // 2
        section = [t, h, half - t - h]
        tok = tokenizer.convert_tokens_to_ids
        return Qwen2VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": dims.lm_hidden,
                "intermediate_size": dims.lm_intermediate,
                "num_hidden_layers": dims.lm_layers,
                "num_attention_heads": dims.lm_heads,
                "num_key_value_heads": dims.lm_kv_heads,
                "max_position_embeddings": 4096,
                "initializer_range": dims.initializer_range,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                "bos_token_id": tok("<|endoftext|>"),
                "eos_token_id": tok("<|im_end|>"),
                "pad_token_id": tok("<|endoftext|>"),
            },
            vision_config={
                "depth": dims.vision_layers,
                "embed_dim": dims.vision_hidden,
                "hidden_size": dims.lm_hidden,
                "num_heads": dims.vision_heads,
                "mlp_ratio": 2,
                "patch_size": dims.patch_size,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "initializer_range": dims.initializer_range,
            },
            image_token_id=tok("<|image_pad|>"),
            video_token_id=tok("<|video_pad|>"),
            vision_start_token_id=tok("<|vision_start|>"),
            vision_end_token_id=tok("<|vision_end|>"),
            dtype=dtype,
        )

    def build_image_processor(self, dims: PresetDims) -> Any:
        factor = dims.patch_size * 2
        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": factor * factor * 4, "longest_edge": dims.image_size * dims.image_size},
            patch_size=dims.patch_size,
            merge_size=2,
            temporal_patch_size=2,
        )

    def save_processor(self, out: Path, dims: PresetDims, tokenizer: Any, config: Any) -> None:
        """``preprocessor_config.json`` and ``video_preprocessor_config.json`` as Qwen2-VL checkpoints saved by
        transformers 5 have them. (HF's ``Qwen2VLProcessor`` and video processor need torchvision, which has no CPU
        build here; Prism's video path runs the image processor per temporal patch.)"""
        image = self.build_image_processor(dims)
        image.save_pretrained(out)
        video = {k: v for k, v in image.to_dict().items() if k not in ("image_processor_type", "processor_class")}
        # Video frames get a quarter of an image's largest area, as real checkpoints bound video below images (and so
        # that a test can tell which bounds a frame was resized within).
        low, high = image.size["shortest_edge"], max(image.size["shortest_edge"], image.size["longest_edge"] // 4)
        video.update(size={"shortest_edge": low, "longest_edge": high}, min_pixels=low, max_pixels=high)
        video.update(video_processor_type="Qwen2VLVideoProcessor", do_sample_frames=False)
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
