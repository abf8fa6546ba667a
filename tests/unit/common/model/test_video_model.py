"""Qwen2-VL video: sampled frames through every stage give exactly ``generate()``'s tokens (greedy), alone and mixed
with an image; LLaVA refuses video with a clear 400."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidRequestError
from common.media.loader import LoadedMedia
from common.media.synthetic import synthetic_image
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_loaded
from common.stages.prompt import build_prompt

SAMPLING = SamplingParams(max_tokens=16)


def _video(n_frames: int, size=(96, 72)) -> LoadedMedia:
    frames = [synthetic_image(*size, seed=100 + i) for i in range(n_frames)]
    return LoadedMedia("video", f"video-{n_frames}", "MP4", 0, frames, [i * 0.5 for i in range(n_frames)])


def _image() -> LoadedMedia:
    return LoadedMedia("image", "image-1", "PNG", 0, [synthetic_image(120, 90, seed=7)])


def _staged(lm, items, content):
    media = process_loaded(lm, items)
    prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 8192)
    pre = prefill(lm, merge(lm, prompt, encode_media(lm, media)), SAMPLING, 16)
    return list(prompt.token_ids), list(decode(lm, pre, SAMPLING).token_ids), media


def _reference(lm, media, content):
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    merge_sq = lm.config.vision_config.spatial_merge_size**2
    kwargs = {}
    for m in media:
        pad = "<|image_pad|>" if m.modality == "image" else "<|video_pad|>"
        n = m.grid_thw[0] * m.grid_thw[1] * m.grid_thw[2] // merge_sq
        prompt = prompt.replace(pad, "<|hold|>" * n, 1).replace("<|hold|>", pad.replace("pad", "PAD"))
    prompt = prompt.replace("<|image_PAD|>", "<|image_pad|>").replace("<|video_PAD|>", "<|video_pad|>")
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    images = [m for m in media if m.modality == "image"]
    videos = [m for m in media if m.modality == "video"]
    if images:
        kwargs["pixel_values"] = torch.cat([torch.from_numpy(m.pixel_values) for m in images])
        kwargs["image_grid_thw"] = torch.tensor([m.grid_thw for m in images])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([torch.from_numpy(m.pixel_values) for m in videos])
        kwargs["video_grid_thw"] = torch.tensor([m.grid_thw for m in videos])
    types = (ids == lm.config.image_token_id).int() + 2 * (ids == lm.config.video_token_id).int()
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=types,
            max_new_tokens=16,
            do_sample=False,
            **kwargs,
        )
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("n_frames", [4, 5])  # 5 → padded to 6 by repeating the last frame
def test_video_matches_generate(tiny_qwen, reference_qwen, n_frames):
    """The stages on the model as they load it (oneDNN-packed linears); ``generate()`` on a stock one."""
    content = [{"type": "video"}, {"type": "text", "text": "What happens in the clip?"}]
    prompt_ids, out, media = _staged(tiny_qwen, [_video(n_frames)], content)
    assert media[0].grid_thw[0] == -(-n_frames // 2)
    ref_prompt, ref_out = _reference(reference_qwen, media, content)
    assert prompt_ids == ref_prompt and out == ref_out
    assert len(set(out)) > 3


def test_image_and_video_in_one_request_match_generate(tiny_qwen, reference_qwen):
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare the picture and the clip."}]
    prompt_ids, out, media = _staged(tiny_qwen, [_image(), _video(4)], content)
    assert [m.modality for m in media] == ["image", "video"]
    ref_prompt, ref_out = _reference(reference_qwen, media, content)
    assert prompt_ids == ref_prompt and out == ref_out


def test_llava_refuses_video(tiny_llava):
    with pytest.raises(InvalidRequestError, match="does not accept video"):
        process_loaded(tiny_llava, [_video(2)])
