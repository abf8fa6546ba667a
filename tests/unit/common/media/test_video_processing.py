"""Qwen2-VL's video path against an independent reference. transformers' video processor cannot run here (it needs
torchvision), so: a static clip must give, in every temporal patch, exactly the patches HF's own image processor
gives for that frame (same resize, normalisation and merge-window order); and a two-frame clip of flat colours must
put each frame in its own temporal slot of every patch, as the layout ``[C, temporal, patch, patch]`` says."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from common.errors import UnsupportedModelError
from common.media.synthetic import synthetic_image


@pytest.mark.parametrize("size", [(160, 120), (96, 200)])
def test_static_clip_equals_the_image_processor_per_temporal_patch(tiny_qwen, size):
    adapter, proc, config = tiny_qwen.adapter, tiny_qwen.image_processor, tiny_qwen.config
    frame = synthetic_image(*size, seed=5)
    video = adapter.process_video(proc, config, [frame] * 4)
    image = proc(images=[frame], return_tensors="np")
    t, gh, gw = video.grid_thw
    assert (t, gh, gw) == (2, *(int(v) for v in image["image_grid_thw"][0][1:]))
    reference = image["pixel_values"]  # [gh * gw, C * temporal * patch * patch]: the frame repeated in time
    per_t = video.pixel_values.reshape(t, gh * gw, -1)
    for i in range(t):
        np.testing.assert_allclose(per_t[i], reference, rtol=0, atol=1e-5)
    assert video.num_visual_tokens == t * gh * gw // config.vision_config.spatial_merge_size**2


def test_two_frame_clip_puts_each_frame_in_its_temporal_slot(tiny_qwen):
    adapter, proc, config = tiny_qwen.adapter, tiny_qwen.image_processor, tiny_qwen.config
    red, blue = (200, 30, 10), (5, 60, 250)
    frames = [Image.new("RGB", (112, 84), red), Image.new("RGB", (112, 84), blue)]
    video = adapter.process_video(proc, config, frames)
    ps, tp = proc.patch_size, proc.temporal_patch_size
    t, gh, gw = video.grid_thw
    assert t == 1 and tp == 2
    patches = video.pixel_values.reshape(gh * gw, 3, tp, ps, ps)
    mean, std = np.asarray(proc.image_mean), np.asarray(proc.image_std)
    for slot, colour in enumerate((red, blue)):
        want = (np.asarray(colour) * proc.rescale_factor - mean) / std  # by hand: rescale, then normalise
        got = patches[:, :, slot].mean(axis=(0, 2, 3))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.ptp(patches[:, :, slot], axis=(0, 2, 3)).max() < 1e-5, "a flat frame gives flat patches"


def test_odd_frame_count_repeats_the_last_frame(tiny_qwen):
    adapter, proc, config = tiny_qwen.adapter, tiny_qwen.image_processor, tiny_qwen.config
    frames = [synthetic_image(96, 96, seed=i) for i in range(3)]
    three = adapter.process_video(proc, config, frames)
    four = adapter.process_video(proc, config, [*frames, frames[-1]])
    assert three.grid_thw == four.grid_thw and three.grid_thw[0] == 2
    np.testing.assert_array_equal(three.pixel_values, four.pixel_values)


def test_frames_are_resized_within_the_checkpoints_video_bounds(tiny_qwen):
    """The built model's ``video_preprocessor_config.json`` bounds video below images (as real checkpoints do); the
    grid and token count are what ``smart_resize`` gives within those bounds, read from the file itself."""
    adapter, proc, config = tiny_qwen.adapter, tiny_qwen.image_processor, tiny_qwen.config
    saved = json.loads((tiny_qwen.model_dir / "video_preprocessor_config.json").read_text())
    low, high = saved["size"]["shortest_edge"], saved["size"]["longest_edge"]
    assert tiny_qwen.video_bounds == (low, high) and high < proc.size.longest_edge
    frames = [synthetic_image(320, 240, seed=i) for i in range(4)]
    video = adapter.process_video(proc, config, frames, tiny_qwen.video_bounds)
    factor = proc.patch_size * proc.merge_size
    h, w = smart_resize(240, 320, factor=factor, min_pixels=low, max_pixels=high)
    assert video.grid_thw == (2, h // proc.patch_size, w // proc.patch_size)
    assert video.num_visual_tokens == 2 * (h // factor) * (w // factor)
    as_images = adapter.process_video(proc, config, frames)
    assert as_images.num_visual_tokens > video.num_visual_tokens  # (the image bounds would give another count)


@pytest.mark.parametrize(
    ("video_config", "bounds"),
    [
        (None, None),
        ({"size": {"shortest_edge": 3136, "longest_edge": 9000}}, (3136, 9000)),
        ({"min_pixels": 3136, "max_pixels": 20000}, (3136, 20000)),
        ({"size": {"shortest_edge": 3136, "longest_edge": 9000}, "max_pixels": 20000}, (3136, 20000)),  # (overrides)
        ({"size": [1, 2]}, "refused"),
        ({"size": {"shortest_edge": 3136, "longest_edge": 9000}, "patch_size": 16}, "refused"),
        ({"do_resize": True}, "refused"),
        ({"size": {"shortest_edge": 9000, "longest_edge": 3136}}, "refused"),
    ],
)
def test_video_bounds_are_read_or_the_checkpoint_refused(tiny_qwen, tmp_path, video_config, bounds):
    if video_config is not None:
        (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    load = lambda: tiny_qwen.adapter.load_video_bounds(str(tmp_path), tiny_qwen.image_processor)  # noqa: E731
    if bounds == "refused":
        with pytest.raises(UnsupportedModelError):
            load()
    else:
        assert load() == bounds
