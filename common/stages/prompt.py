"""Prompt stage: chat messages + processed media → token ids with expanded placeholders and the span map.

The model directory's own chat template renders the conversation with **one** placeholder token per media item; the
tokenizer turns it into ids; each placeholder is then expanded to that item's ``num_visual_tokens`` copies, and a
:class:`PlaceholderSpan` records where. Placeholders are matched to media strictly in order of appearance.

A user's text that spells a placeholder token (``"<image>"``) would tokenize to the special token and shift every
image after it; that shows up as a count mismatch and is refused with a 400 rather than silently mis-aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.errors import InvalidRequestError, SpanMismatchError
from common.model.loader import ModelFrontend
from common.protocol.handoff import MediaSlot, PlaceholderSpan, TokenizedPrompt


def render_chat(
    lm: ModelFrontend, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> str:
    """Chat template → prompt text, with the generation prompt appended (and the function definitions ``tools``, which
    the template renders in its own format)."""
    try:
        return lm.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja errors on malformed messages are the client's fault
        raise InvalidRequestError(f"messages cannot be rendered by the chat template: {exc}", param="messages") from exc


def expand_placeholders(lm: ModelFrontend, token_ids: Sequence[int], media: Sequence[MediaSlot]) -> TokenizedPrompt:
    """Expand one placeholder per media item into its visual-token run and record the spans."""
    placeholder = {m: lm.placeholder_id(m) for m in lm.adapter.modalities}
    for item in media:
        if item.modality not in placeholder:
            raise InvalidRequestError(f"model {lm.served_name} does not accept {item.modality} input", param="messages")
    by_id = {v: k for k, v in placeholder.items()}
    found = [(i, by_id[t]) for i, t in enumerate(token_ids) if t in by_id]
    if len(found) != len(media):
        raise SpanMismatchError(
            f"prompt has {len(found)} media placeholders but the request has {len(media)} media items",
            param="messages",
        )
    out: list[int] = []
    spans = []
    prev = 0
    for (pos, modality), item in zip(found, media, strict=True):
        if modality != item.modality:
            raise SpanMismatchError(
                f"placeholder #{item.media_index} is {modality} but the media item is {item.modality}"
            )
        out.extend(token_ids[prev:pos])
        spans.append(
            PlaceholderSpan(
                media_index=item.media_index,
                modality=item.modality,
                prompt_token_start=len(out),
                prompt_token_length=item.num_visual_tokens,
                embedding_shape=(item.num_visual_tokens, lm.hidden_size),
                media_digest=item.media_digest,
                grid_thw=item.grid_thw,
            )
        )
        out.extend([placeholder[modality]] * item.num_visual_tokens)
        prev = pos + 1
    out.extend(token_ids[prev:])
    return TokenizedPrompt(token_ids=np.asarray(out, dtype=np.int64), spans=tuple(spans))


def build_prompt(
    lm: ModelFrontend,
    messages: Sequence[dict[str, Any]],
    media: Sequence[MediaSlot],
    max_prompt_tokens: int,
    tools: Sequence[dict[str, Any]] | None = None,
) -> TokenizedPrompt:
    """Render, tokenize, expand; refuse prompts over ``max_prompt_tokens`` after expansion."""
    text = render_chat(lm, messages, tools)
    ids = lm.tokenizer(text)["input_ids"]
    prompt = expand_placeholders(lm, ids, media)
    if len(prompt.token_ids) > max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt is {len(prompt.token_ids)} tokens after expanding media placeholders; "
            f"the limit is {max_prompt_tokens}",
            code="prompt_too_long",
            param="messages",
        )
    return prompt
