"""A request's resource vector: what it costs in every unit a stage budgets, filled in as each part becomes known.

Prompt length alone says little about a VLM request's cost: one 4K image is thousands of vision patches and visual
tokens behind a ten-word prompt. Every request is measured as a vector (media items and bytes, pixels, frames,
patches, visual tokens, text tokens, max output tokens, KV blocks), filled in as each part becomes known:

* at the ingress (:meth:`ResourceVector.at_ingress`): text tokens (the prompt rendered with one placeholder per
  media item), media items, data-URL bytes, ``max_tokens``. A text-only request is then complete: its KV blocks are
  exact, and every limit is checked there;
* in the media stage, right after the header check and the processor (:meth:`ResourceVector.with_media`): pixels,
  frames, patches, visual tokens — and so the exact prompt length and KV blocks, checked **before** the encoder
  queue.

The vector travels with every stage call (``RequestContext.vector``). The limits on it are
:func:`common.admission.limits.check_limits`; the in-flight budgets and tenant quotas that charge it are the rest of
:mod:`common.admission`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol


class MediaFigures(Protocol):
    """What the vector reads of a processed media item (:class:`common.protocol.handoff.ProcessedMedia` has it)."""

    @property
    def modality(self) -> str: ...
    @property
    def grid_thw(self) -> tuple[int, int, int]: ...
    @property
    def source_size(self) -> tuple[int, int]: ...
    @property
    def num_visual_tokens(self) -> int: ...
    @property
    def patches(self) -> int: ...


@dataclass(frozen=True)
class ResourceVector:
    media_items: int
    media_bytes: int
    pixels: int
    frames: int
    patches: int
    visual_tokens: int
    text_tokens: int
    max_output_tokens: int
    """Every choice's ``max_tokens`` together (``choices`` × ``max_tokens``)."""
    kv_blocks: int
    choices: int = 1
    """``n``: sequences decoded from the one prompt (its full KV blocks shared: :func:`choices_blocks`)."""

    @property
    def prompt_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens

    @classmethod
    def at_ingress(
        cls,
        rendered_tokens: int,
        media_items: int,
        max_output_tokens: int,
        block_size: int,
        media_bytes: int = 0,
        choices: int = 1,
    ) -> ResourceVector:
        """What the ingress knows: the prompt rendered with one placeholder token per media item. Each placeholder
        becomes the item's visual tokens later, so ``text_tokens`` excludes them; ``kv_blocks`` is exact for a
        text-only request and a lower bound otherwise. ``max_output_tokens``: one choice's."""
        text = rendered_tokens - media_items
        return cls(
            media_items=media_items,
            media_bytes=media_bytes,
            pixels=0,
            frames=0,
            patches=0,
            visual_tokens=media_items,  # at least one token each: the lower bound until the media stage knows
            text_tokens=text,
            max_output_tokens=choices * max_output_tokens,
            kv_blocks=choices_blocks(block_size, rendered_tokens, max_output_tokens, choices),
            choices=choices,
        )

    def with_media(
        self,
        media: Sequence[MediaFigures],
        block_size: int,
        visual_tokens: int | None = None,
        media_bytes: int | None = None,
    ) -> ResourceVector:
        """The vector completed by the processed media (the media stage, before the encoder queue). ``media_bytes``:
        what the stage fetched and decoded from (URLs included; the ingress could count only data URLs)."""
        visual = sum(m.num_visual_tokens for m in media) if visual_tokens is None else visual_tokens
        return replace(
            self,
            media_items=len(media),
            media_bytes=self.media_bytes if media_bytes is None else media_bytes,
            pixels=sum(m.source_size[0] * m.source_size[1] * _frames(m) for m in media),
            frames=sum(_frames(m) for m in media),
            patches=sum(m.patches for m in media),
            visual_tokens=visual,
            kv_blocks=self.kv_blocks_of(self.text_tokens + visual, block_size),
        )

    def kv_blocks_of(self, prompt_tokens: int, block_size: int) -> int:
        """The KV blocks of this request with a prompt of ``prompt_tokens``."""
        per_choice = self.max_output_tokens // self.choices
        return choices_blocks(block_size, prompt_tokens, per_choice, self.choices)


def choices_blocks(block_size: int, prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
    """Blocks ``n`` sequences of one prompt need at most (``max_tokens`` each): the first its prompt + output; each
    other its own blocks past the prompt's *full* blocks, which all ``n`` share (a partial last block is copied:
    each choice writes its next tokens into it)."""
    span = -(-(prompt_tokens + max_tokens) // block_size)
    return span + (n - 1) * (span - prompt_tokens // block_size)


def _frames(m: MediaFigures) -> int:
    """1 for an image; a video's temporal grid (Qwen2-VL: one per two sampled frames — the media stage counts every
    sampled frame against ``max_request_pixels`` from the headers, before decoding)."""
    return m.grid_thw[0] if m.modality == "video" else 1
