"""The embedded-model builder: deterministic bytes, standard HF directories, non-degenerate weights, caching."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from common.config import ModelConfig
from common.errors import UnsupportedModelError
from common.model.builder import EMBEDDED_MODELS, build_embedded_model, resolve_model_dir
from common.model.loader import load_model


def _file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.parametrize("name", ["prism-tiny-llava", "prism-tiny-qwen2vl"])
def test_build_is_deterministic(name, tmp_path):
    a = _file_hashes(build_embedded_model(name, tmp_path / "a"))
    b = _file_hashes(build_embedded_model(name, tmp_path / "b"))
    assert a == b
    for required in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert required in a
    assert ("processor_config.json" if "llava" in name else "video_preprocessor_config.json") in a


def test_llava_directory_gives_a_working_auto_processor(model_cache):
    """A llava-hf checkpoint's ``AutoProcessor`` expands ``<image>`` to the visual tokens; ours must do the same
    (without ``processor_config.json`` it came back with ``patch_size=None`` and failed on the first image)."""
    from transformers import AutoConfig, AutoProcessor, LlavaProcessor

    from common.media.synthetic import synthetic_image

    d = resolve_model_dir("prism-tiny-llava", model_cache)
    proc = AutoProcessor.from_pretrained(d)
    config = AutoConfig.from_pretrained(d)
    assert isinstance(proc, LlavaProcessor) and proc.patch_size == config.vision_config.patch_size
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    out = proc(text=text, images=[synthetic_image(200, 150, seed=1)], return_tensors="pt")
    grid = config.vision_config.image_size // config.vision_config.patch_size
    assert int((out["input_ids"] == config.image_token_id).sum()) == grid * grid
    assert tuple(out["pixel_values"].shape[-2:]) == (config.vision_config.image_size,) * 2


def test_qwen2vl_directory_has_the_files_a_real_checkpoint_has(model_cache):
    """HF's ``Qwen2VLProcessor`` and video processor need torchvision (no CPU build here): check what can load —
    config, tokenizer, the PIL image processor — and that the video processor's file agrees with them."""
    import json

    from transformers import AutoConfig

    d = resolve_model_dir("prism-tiny-qwen2vl", model_cache)
    config = AutoConfig.from_pretrained(d)
    image = AutoImageProcessor.from_pretrained(d, backend="pil")
    video = json.loads((d / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert video["patch_size"] == image.patch_size == config.vision_config.patch_size
    assert video["temporal_patch_size"] == image.temporal_patch_size == config.vision_config.temporal_patch_size
    assert video["merge_size"] == image.merge_size == config.vision_config.spatial_merge_size
    assert video["image_mean"] == list(image.image_mean)
    # (video frames are bounded below images, as in real checkpoints: the same least area, a quarter of the largest)
    low, high = image.size["shortest_edge"], image.size["longest_edge"] // 4
    assert video["size"] == {"shortest_edge": low, "longest_edge": high}
    assert (video["min_pixels"], video["max_pixels"]) == (low, high)
    assert AutoTokenizer.from_pretrained(d).chat_template


@pytest.mark.parametrize("name", ["prism-tiny-llava", "prism-tiny-qwen2vl"])
def test_loads_with_plain_transformers_and_is_not_degenerate(name, tmp_path):
    d = build_embedded_model(name, tmp_path / name)
    model = AutoModelForImageTextToText.from_pretrained(d).eval()
    tok = AutoTokenizer.from_pretrained(d)
    assert AutoImageProcessor.from_pretrained(d, backend="pil") is not None
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
    assert len(set(out)) >= 8, f"greedy output is degenerate: {out}"


def test_resolve_builds_once_and_concurrently(tmp_path):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_dir("prism-tiny-llava", tmp_path)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    before = _file_hashes(results[0])
    assert resolve_model_dir("prism-tiny-llava", tmp_path) == results[0]
    assert _file_hashes(results[0]) == before
    leftovers = [p.name for p in tmp_path.iterdir() if p.is_dir() and p != results[0]]
    assert leftovers == [], "temp build directories must not be left behind"


def test_checkpoint_directory_loads_through_the_same_path(tmp_path, model_cache):
    """Any local HF directory of a supported family loads; the family comes from config.json, not the name."""
    src = resolve_model_dir("prism-tiny-llava", model_cache)
    ckpt = tmp_path / "qwen2-vl-looking-name"  # a misleading name must not matter
    shutil.copytree(src, ckpt)
    lm = load_model(ModelConfig(model=str(ckpt), cache_dir=str(tmp_path / "unused")))
    assert lm.contract.family == "llava"
    assert lm.served_name == "qwen2-vl-looking-name"
    assert not list((tmp_path / "unused").glob("prism-*")), "no embedded model is built for a checkpoint directory"


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(UnsupportedModelError, match="neither a local model directory"):
        resolve_model_dir("llava-1.5-7b-hf", tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "whisper"}')
    with pytest.raises(UnsupportedModelError, match="'whisper' is not a supported family"):
        load_model(ModelConfig(model=str(bad), cache_dir=str(tmp_path)))


def test_embedded_model_names_cover_both_families_and_presets():
    assert set(EMBEDDED_MODELS) == {
        "prism-tiny-llava",
        "prism-tiny-qwen2vl",
        "prism-small-llava",
        "prism-small-qwen2vl",
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prism-small-llava", "prism-small-qwen2vl"])
def test_small_preset_size_and_bf16(name, model_cache):
    lm = load_model(ModelConfig(model=name, cache_dir=model_cache, dtype="bfloat16"))
    params = sum(p.numel() for p in lm.model.parameters())
    assert 10_000_000 <= params <= 100_000_000, params
    assert lm.dtype == torch.bfloat16 and lm.contract.dtype == "bfloat16"
    from common.media.synthetic import synthetic_image
    from common.protocol.sampling import SamplingParams
    from common.reference.pipeline import run_request

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    out = run_request(lm, messages, [synthetic_image(320, 240)], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out.output.token_ids) == 16
    assert len(set(out.output.token_ids)) >= 4
