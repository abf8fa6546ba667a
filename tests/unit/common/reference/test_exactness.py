"""The staged path (process → prompt → encode → merge → prefill → KV blocks → decode) must produce exactly the
token ids of transformers' ``model.generate()`` (greedy) for the same model and input.

The reference inputs are built the way a transformers user would: LLaVA through ``AutoProcessor.from_pretrained`` of
the model directory (a ``LlavaProcessor`` configured by the checkpoint's ``processor_config.json``);
Qwen2-VL (whose processor needs torchvision) by expanding ``<|image_pad|>`` in the prompt text exactly as
``Qwen2VLProcessor`` does, with the family's PIL image processor for pixels.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor, LlavaProcessor

from common.engine.decode import DecodeEngine
from common.engine.prefill import PrefillEngine
from common.kv.pool import KVPool
from common.media.synthetic import synthetic_image
from common.model.linear import PackedLinear
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt

MAX_NEW = 20


@pytest.fixture(scope="module")
def llava(tiny_llava):
    """The model as the stages load it (linear layers packed for oneDNN: :mod:`common.model.linear`)."""
    return tiny_llava


@pytest.fixture(scope="module")
def qwen(tiny_qwen):
    return tiny_qwen


@pytest.fixture(scope="module")
def stock(reference_llava, reference_qwen):
    """``generate()``'s side: model objects of this module's own, with PyTorch's own linear layers."""
    return {"llava": reference_llava, "qwen": reference_qwen}


@pytest.fixture(params=["llava", "qwen"])
def any_model(request, llava, qwen):
    return llava if request.param == "llava" else qwen


def _messages(n_images: int, text: str = "Describe the picture.") -> list[dict]:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _reference_llava(lm, messages, images):
    prompt = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not images:
        inputs = lm.tokenizer(prompt, return_tensors="pt")
    else:
        proc = AutoProcessor.from_pretrained(lm.model_dir)  # the checkpoint's own processor_config.json
        assert isinstance(proc, LlavaProcessor)
        inputs = proc(text=prompt, images=images, return_tensors="pt")
    return dict(inputs)


def _reference_qwen(lm, messages, images):
    prompt = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    extra = {}
    if images:
        px = lm.image_processor(images=images, return_tensors="pt")
        merge = lm.config.vision_config.spatial_merge_size
        for grid in px["image_grid_thw"]:
            n = int(grid.prod()) // (merge * merge)
            prompt = prompt.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
        prompt = prompt.replace("<|placeholder|>", "<|image_pad|>")
        extra = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]}
    inputs = lm.tokenizer(prompt, return_tensors="pt")
    inputs = dict(inputs, **extra)
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == lm.config.image_token_id).int()
    return inputs


def _generate(ref, inputs) -> tuple[list[int], list[int]]:
    """``generate()`` of ``ref``, a stock model object (``stock``), never the one the staged side runs."""
    assert not any(isinstance(m, PackedLinear) for m in ref.model.modules())
    with torch.inference_mode():
        out = ref.model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


CASES = {
    "text_only": [],
    "one_image": [(320, 240)],
    "three_images_of_different_sizes": [(640, 480), (200, 300), (96, 96)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_staged_equals_generate(case, family, llava, qwen, stock):
    lm = llava if family == "llava" else qwen
    images = [synthetic_image(w, h, seed=i + 7) for i, (w, h) in enumerate(CASES[case])]
    messages = _messages(len(images))
    reference = _reference_llava if family == "llava" else _reference_qwen
    ref_prompt, ref_out = _generate(stock[family], reference(lm, messages, images))

    got = run_request(lm, messages, images, SamplingParams(max_tokens=MAX_NEW))
    assert list(got.prompt_token_ids) == ref_prompt
    assert list(got.output.token_ids) == ref_out
    assert len(set(ref_out)) > 3, "degenerate model output would make this comparison meaningless"


def test_multi_turn_conversation_matches_generate(llava, stock):
    lm = llava
    images = [synthetic_image(300, 200, seed=3)]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is here?"}]},
        {"role": "assistant", "content": "A red circle."},
        {"role": "user", "content": "And what colour is the sky?"},
    ]
    ref_prompt, ref_out = _generate(stock["llava"], _reference_llava(lm, messages, images))
    got = run_request(lm, messages, images, SamplingParams(max_tokens=MAX_NEW))
    assert list(got.prompt_token_ids) == ref_prompt
    assert list(got.output.token_ids) == ref_out


def test_qwen_two_dynamic_resolutions(qwen, stock):
    """Two images whose processed grids differ: each gets its own token count and M-RoPE positions."""
    lm = qwen
    images = [synthetic_image(448, 224, seed=1), synthetic_image(84, 140, seed=2)]
    messages = _messages(2, "Compare them.")
    inputs = _reference_qwen(lm, messages, images)
    grids = [tuple(g.tolist()) for g in inputs["image_grid_thw"]]
    assert grids[0] != grids[1]
    ref_prompt, ref_out = _generate(stock["qwen"], inputs)
    got = run_request(lm, messages, images, SamplingParams(max_tokens=MAX_NEW))
    assert list(got.prompt_token_ids) == ref_prompt
    assert list(got.output.token_ids) == ref_out

    # Each resolution alone also matches (the rope delta differs per resolution).
    for image in images:
        inputs = _reference_qwen(lm, _messages(1), [image])
        ref_prompt, ref_out = _generate(stock["qwen"], inputs)
        got = run_request(lm, _messages(1), [image], SamplingParams(max_tokens=MAX_NEW))
        assert list(got.output.token_ids) == ref_out


def test_different_images_give_different_answers(any_model):
    """The vision path matters: if it were ignored, two different images would give the same tokens."""
    a = run_request(any_model, _messages(1), [synthetic_image(320, 240, seed=1)], SamplingParams(max_tokens=12))
    b = run_request(any_model, _messages(1), [synthetic_image(320, 240, seed=2)], SamplingParams(max_tokens=12))
    assert a.output.token_ids != b.output.token_ids


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_logprobs_are_log_softmax_of_generates_logits(family, llava, qwen, stock):
    """The engines' log-probabilities (prefill's first token through its hand-off, then decode's, batched with a
    sequence that asks for none) equal ``log_softmax`` of the logits ``generate()`` saw at each position, within
    1e-4, and the top alternatives are its true top 5."""
    ref, lm = stock[family], (llava if family == "llava" else qwen)  # (generate on its own model object)
    images = [synthetic_image(320, 240, seed=7)]
    messages = _messages(1)
    inputs = (_reference_llava if family == "llava" else _reference_qwen)(ref, messages, images)
    with torch.inference_mode():
        out = ref.model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
    expected_ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    expected = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]

    media = process_images(lm, images)
    merged = merge(lm, build_prompt(lm, messages, media, 4096), encode_media(lm, media))
    asked, free = SamplingParams(max_tokens=MAX_NEW, logprobs=5), SamplingParams(max_tokens=MAX_NEW)
    engine = DecodeEngine(lm, KVPool(256, 16, lm.kv_shape, lm.dtype), max_batch=4)
    for rid, sampling in (("asked", asked), ("free", free)):
        engine.submit(rid, PrefillEngine(lm, 16, chunk_tokens=64).run(rid, merged, sampling).output, sampling)
    events: dict[str, list] = {"asked": [], "free": []}
    while engine.has_work():
        for event in engine.step():
            events[event.request_id].append(event)
    assert [e.token_id for e in events["asked"]] == [e.token_id for e in events["free"]] == expected_ids
    assert all(e.logprob is None for e in events["free"])
    for event, row in zip(events["asked"], expected, strict=True):
        assert abs(event.logprob.logprob - float(row[event.token_id])) < 1e-4
        best = torch.topk(row, 5)
        assert [i for i, _ in event.logprob.top] == best.indices.tolist()
        assert max(abs(v - float(w)) for (_, v), w in zip(event.logprob.top, best.values, strict=True)) < 1e-4
