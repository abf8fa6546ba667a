"""Typed hand-off objects passed between the stages of one request.

A request flows process → encode → merge → prefill → decode; each arrow is one of these objects. They hold only
numpy arrays and plain Python scalars/tuples, never torch tensors or model objects, so they can cross a process
boundary (Ray object store, NIXL, or :mod:`common.protocol.wire` bytes) without dragging torch or pickled code with
them. They are frozen: a stage makes a new object rather than mutating one it received.

Layout notes that the stages rely on:

* ``ProcessedMedia.pixel_values`` is in the family's own layout (LLaVA: ``[3, H, W]``; Qwen2-VL: flattened
  patches ``[num_patches, patch_dim]``); ``grid_thw`` is the patch grid before any spatial merge.
* ``VisualEmbeddings.embeddings`` is ``[num_visual_tokens, lm_hidden]``: exactly one block per media item.
* ``KVBlocks.keys/values`` are ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``; the last block
  is zero-padded past ``num_tokens``. bfloat16 has no numpy dtype, so it travels as its raw ``uint16`` bits with
  ``dtype="bfloat16"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

Modality = Literal["image", "video"]


@dataclass(frozen=True)
class ProcessedMedia:
    """One media item after decode and the model's processor: ready for the vision tower."""

    media_index: int
    modality: Modality
    media_digest: str
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_visual_tokens: int
    source_size: tuple[int, int]
    """Original (width, height) before the processor resized it."""


@dataclass(frozen=True)
class VisualEmbeddings:
    """Vision tower + projector output for one media item."""

    media_index: int
    modality: Modality
    media_digest: str
    embeddings: np.ndarray
    grid_thw: tuple[int, int, int]
    encoder_revision: str

    @property
    def num_visual_tokens(self) -> int:
        return int(self.embeddings.shape[0])


class MediaSlot(Protocol):
    """What prompt building needs of a media item: :class:`ProcessedMedia` and :class:`VisualEmbeddings` both are
    one, so the prefill stage can build the prompt from embeddings without ever seeing pixels."""

    @property
    def media_index(self) -> int: ...
    @property
    def modality(self) -> Modality: ...
    @property
    def media_digest(self) -> str: ...
    @property
    def grid_thw(self) -> tuple[int, int, int]: ...
    @property
    def num_visual_tokens(self) -> int: ...


@dataclass(frozen=True)
class PlaceholderSpan:
    """Where one media item's embeddings go in the prompt: ``prompt_token_length`` placeholder tokens from
    ``prompt_token_start``; the embedding block must be ``embedding_shape`` and come from ``media_digest``."""

    media_index: int
    modality: Modality
    prompt_token_start: int
    prompt_token_length: int
    embedding_shape: tuple[int, int]
    media_digest: str
    grid_thw: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.prompt_token_start + self.prompt_token_length


@dataclass(frozen=True)
class TokenizedPrompt:
    """Prompt token ids with every placeholder expanded, and the span map that says which media fills which."""

    token_ids: np.ndarray
    spans: tuple[PlaceholderSpan, ...]


@dataclass(frozen=True)
class MergedInputs:
    """Prompt embeddings with visual embeddings scattered into their validated spans."""

    token_ids: np.ndarray
    inputs_embeds: np.ndarray
    spans: tuple[PlaceholderSpan, ...]


@dataclass(frozen=True)
class KVBlocks:
    """A sequence's KV cache cut into fixed-size blocks (see module docstring for the layout)."""

    block_size: int
    num_tokens: int
    dtype: str
    keys: np.ndarray
    values: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


@dataclass(frozen=True)
class PrefillOutput:
    """Everything decode needs to continue a sequence that prefill started, in another process if need be."""

    prompt_token_ids: np.ndarray
    first_token_id: int
    kv: KVBlocks
    rope_delta: int
    """Qwen2-VL M-RoPE: decode position = cache position + rope_delta (0 for 1-D RoPE families)."""
    model_revision: str
