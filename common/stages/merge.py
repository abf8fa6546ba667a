"""Merge stage: validate the placeholder-span map against the embeddings, then scatter them into the prompt.

Validation happens before any tensor work, so every inconsistency is a typed :class:`SpanMismatchError` naming what
disagrees — never a shape crash deep inside the model:

* one embedding block per span, in the same order (``media_index`` 0..n-1) and from the same media
  (``media_digest``: catches swapped images of equal size);
* each span's length equals its block's rows, and the width equals the LM hidden size;
* spans lie inside the prompt, do not overlap, cover only placeholder tokens, and every placeholder token in the
  prompt is covered by a span;
* embeddings came from this model's encoder revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.errors import RevisionMismatch, SpanMismatchError
from common.model.loader import LoadedModel
from common.protocol.handoff import MergedInputs, PlaceholderSpan, TokenizedPrompt, VisualEmbeddings


def validate_spans(
    token_ids: np.ndarray,
    spans: Sequence[PlaceholderSpan],
    embeddings: Sequence[VisualEmbeddings],
    placeholder_ids: dict[str, int],
    hidden_size: int,
    encoder_revision: str,
) -> None:
    """Raise :class:`SpanMismatchError` unless spans, prompt and embeddings agree exactly."""
    if len(spans) != len(embeddings):
        raise SpanMismatchError(f"{len(spans)} placeholder spans but {len(embeddings)} embedding blocks")
    n = len(token_ids)
    covered = np.zeros(n, dtype=bool)
    prev_end = 0
    for i, (span, emb) in enumerate(zip(spans, embeddings, strict=True)):
        if span.media_index != i or emb.media_index != i:
            raise SpanMismatchError(
                f"media order mismatch at position {i}: span is media #{span.media_index}, "
                f"embedding is media #{emb.media_index}"
            )
        if span.media_digest != emb.media_digest:
            raise SpanMismatchError(f"media #{i}: span and embedding come from different media (digest mismatch)")
        if span.modality != emb.modality:
            raise SpanMismatchError(f"media #{i}: span is {span.modality}, embedding is {emb.modality}")
        if emb.encoder_revision != encoder_revision:
            raise RevisionMismatch(f"media #{i}: embedding is from encoder {emb.encoder_revision}, not this model's")
        rows, width = emb.embeddings.shape if emb.embeddings.ndim == 2 else (-1, -1)
        if (rows, width) != (span.prompt_token_length, hidden_size) or tuple(span.embedding_shape) != (rows, width):
            raise SpanMismatchError(
                f"media #{i}: span wants {span.prompt_token_length}×{hidden_size} "
                f"(declared {tuple(span.embedding_shape)}), embedding is {tuple(emb.embeddings.shape)}"
            )
        if span.prompt_token_start < prev_end or span.end > n or span.prompt_token_length <= 0:
            raise SpanMismatchError(
                f"media #{i}: span [{span.prompt_token_start}, {span.end}) is out of order or range"
            )
        if not np.all(token_ids[span.prompt_token_start : span.end] == placeholder_ids[span.modality]):
            raise SpanMismatchError(f"media #{i}: span covers tokens that are not {span.modality} placeholders")
        covered[span.prompt_token_start : span.end] = True
        prev_end = span.end
    stray = np.isin(token_ids, list(placeholder_ids.values())) & ~covered
    if stray.any():
        raise SpanMismatchError(f"{int(stray.sum())} placeholder tokens are not covered by any media span")


def merge(lm: LoadedModel, prompt: TokenizedPrompt, embeddings: Sequence[VisualEmbeddings]) -> MergedInputs:
    placeholder_ids = {m: lm.placeholder_id(m) for m in lm.adapter.modalities}
    validate_spans(prompt.token_ids, prompt.spans, embeddings, placeholder_ids, lm.hidden_size, lm.contract.encoder_key)
    with torch.inference_mode():
        text = lm.model.get_input_embeddings()(torch.from_numpy(prompt.token_ids))
    inputs = text.float().numpy().copy()
    for span, emb in zip(prompt.spans, embeddings, strict=True):
        inputs[span.prompt_token_start : span.end] = emb.embeddings
    return MergedInputs(token_ids=prompt.token_ids, inputs_embeds=inputs, spans=prompt.spans)
