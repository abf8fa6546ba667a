"""Qwen2-VL's video path against an independent reference. transformers' video processor cannot run here (it needs
torchvision), so: a static clip must give, in every temporal patch, exactly the patches HF's own image processor
gives for that frame (same resize, normalisation and merge-window order); and a two-frame clip of flat colours must
put each frame in its own temporal slot of every patch, as the layout ``[C, temporal, patch, patch]`` says."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

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
