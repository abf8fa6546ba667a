"""Placeholder/media mismatches are caught before any tensor work, as typed 400 errors naming what disagrees."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from common.errors import HandoffLost, InvalidRequestError, RevisionMismatch, SpanMismatchError
from common.media.synthetic import synthetic_image
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt


def _request(lm, sizes, text="Describe."):
    images = [synthetic_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    media = process_images(lm, images)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 4096)
    return media, prompt, encode_media(lm, media)


def _expect(exc_type, match, fn, *args):
    with pytest.raises(exc_type, match=match) as info:
        fn(*args)
    assert info.value.http_status == 400
    body = info.value.to_body()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]
    return info.value


def test_valid_request_merges(tiny_model):
    _, prompt, emb = _request(tiny_model, [(320, 240), (128, 256)])
    merged = merge(tiny_model, prompt, emb)
    for span, e in zip(merged.spans, emb, strict=True):
        np.testing.assert_array_equal(merged.inputs_embeds[span.prompt_token_start : span.end], e.embeddings)


def test_more_images_than_placeholders(tiny_model):
    lm = tiny_model
    media = process_images(lm, [synthetic_image(64, 64, seed=1), synthetic_image(64, 64, seed=2)])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    err = _expect(
        SpanMismatchError, "1 media placeholders but the request has 2", build_prompt, lm, messages, media, 4096
    )
    assert err.code == "placeholder_mismatch"


def test_placeholder_without_image(tiny_model):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    _expect(
        SpanMismatchError, "1 media placeholders but the request has 0", build_prompt, tiny_model, messages, [], 4096
    )


def test_placeholder_token_typed_in_user_text_is_refused(tiny_model):
    """A user who types the placeholder token would shift every image; it is a count mismatch, not a silent shift."""
    token = tiny_model.adapter.placeholder_token("image")
    media = process_images(tiny_model, [synthetic_image(64, 64)])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"see {token} here"}]}]
    _expect(SpanMismatchError, "2 media placeholders", build_prompt, tiny_model, messages, media, 4096)


def test_fewer_embeddings_than_spans(tiny_model):
    _, prompt, emb = _request(tiny_model, [(320, 240), (128, 256)])
    _expect(SpanMismatchError, "2 placeholder spans but 1 embedding blocks", merge, tiny_model, prompt, emb[:1])


def test_wrong_embedding_length(tiny_model):
    _, prompt, emb = _request(tiny_model, [(320, 240)])
    short = [replace(emb[0], embeddings=emb[0].embeddings[:-1])]
    _expect(SpanMismatchError, "media #0: span wants", merge, tiny_model, prompt, short)


def test_wrong_embedding_width(tiny_model):
    _, prompt, emb = _request(tiny_model, [(320, 240)])
    wide = [replace(emb[0], embeddings=np.zeros((emb[0].embeddings.shape[0], 7), np.float32))]
    _expect(SpanMismatchError, "media #0", merge, tiny_model, prompt, wide)


def test_swapped_image_order_is_caught(tiny_model):
    _, prompt, emb = _request(tiny_model, [(200, 200), (200, 200)])
    # Swapped as delivered: indices out of order.
    _expect(SpanMismatchError, "media order mismatch", merge, tiny_model, prompt, [emb[1], emb[0]])
    # Swapped and re-indexed (same shapes, so only the digest can tell): still caught.
    relabelled = [replace(emb[1], media_index=0), replace(emb[0], media_index=1)]
    _expect(SpanMismatchError, "different media", merge, tiny_model, prompt, relabelled)


def test_embeddings_from_another_encoder_are_refused(tiny_model):
    """Not the client's fault (a rolling update's stages of two revisions): a lost hand-off, issued again."""
    _, prompt, emb = _request(tiny_model, [(100, 100)])
    foreign = [replace(emb[0], encoder_revision="other:encoder:float32")]
    with pytest.raises(RevisionMismatch, match="not this model's") as info:
        merge(tiny_model, prompt, foreign)
    assert isinstance(info.value, HandoffLost) and info.value.to_body()["error"]["code"] == "model_revision_mismatch"


def test_span_must_cover_only_placeholders(tiny_model):
    _, prompt, emb = _request(tiny_model, [(100, 100)])
    s = prompt.spans[0]
    shifted = replace(prompt, spans=(replace(s, prompt_token_start=s.prompt_token_start - 1),))
    _expect(SpanMismatchError, "not image placeholders", merge, tiny_model, shifted, emb)
    outside = replace(prompt, spans=(replace(s, prompt_token_start=len(prompt.token_ids)),))
    _expect(SpanMismatchError, "out of order or range", merge, tiny_model, outside, emb)


def test_stray_placeholder_tokens_are_refused(tiny_model):
    _, prompt, emb = _request(tiny_model, [(100, 100)])
    pid = tiny_model.placeholder_id("image")
    ids = np.concatenate([prompt.token_ids, [pid]])
    _expect(SpanMismatchError, "not covered", merge, tiny_model, replace(prompt, token_ids=ids), emb)


def test_prompt_over_limit_names_the_limit(tiny_model):
    media = process_images(tiny_model, [synthetic_image(64, 64)])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    err = _expect(InvalidRequestError, "the limit is 10", build_prompt, tiny_model, messages, media, 10)
    assert err.code == "prompt_too_long"


def test_llava_refuses_video(tiny_llava):
    media = [replace(process_images(tiny_llava, [synthetic_image(64, 64)])[0], modality="video")]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    _expect(InvalidRequestError, "does not accept video", build_prompt, tiny_llava, messages, media, 4096)
