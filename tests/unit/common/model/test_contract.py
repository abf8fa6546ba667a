"""The model contract: each revision moves exactly when the part it covers changes."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file

from common.config import ModelConfig
from common.model.builder import resolve_model_dir
from common.model.loader import load_model
from common.model.registry import family_for_dir


def _contract(path, cache):
    return load_model(ModelConfig(model=str(path), cache_dir=cache)).contract


def _changed(a, b) -> set[str]:
    da, db = a.model_dump(), b.model_dump()
    return {k for k in da if da[k] != db[k] and k not in ("model_dir", "model_id")}


def _edit_tensor(ckpt, select) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    name = sorted(k for k in tensors if select(k))[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, path, metadata={"format": "pt"})


def test_contract_is_stable_and_complete(tiny_llava, tiny_qwen, model_cache):
    for lm in (tiny_llava, tiny_qwen):
        again = _contract(lm.model_dir, model_cache)
        assert _changed(lm.contract, again) == set()
        values = [v for k, v in lm.contract.model_dump().items() if k.endswith("_revision")]
        assert len(set(values)) == len(values), "distinct parts must not share a revision"
    assert tiny_llava.contract.model_revision != tiny_qwen.contract.model_revision


def test_each_revision_tracks_its_part(tmp_path, model_cache):
    src = resolve_model_dir("prism-tiny-qwen2vl", model_cache)
    base = _contract(src, model_cache)
    adapter = family_for_dir(src)

    def projector(k: str) -> bool:
        return k.startswith(adapter.projector_prefixes)

    def vision(k: str) -> bool:
        return k.startswith(adapter.vision_prefixes) and not projector(k)

    def language(k: str) -> bool:
        return not k.startswith(adapter.vision_prefixes)

    def variant(name, edit):
        ckpt = tmp_path / name
        shutil.copytree(src, ckpt)
        edit(ckpt)
        return _changed(base, _contract(ckpt, model_cache))

    assert variant("vision", lambda c: _edit_tensor(c, vision)) == {
        "vision_encoder_revision",
        "model_revision",
    }
    assert variant("projector", lambda c: _edit_tensor(c, projector)) == {
        "projector_revision",
        "model_revision",
    }
    assert variant("lm", lambda c: _edit_tensor(c, language)) == {"model_revision"}

    def template(c):
        (c / "chat_template.jinja").write_text((c / "chat_template.jinja").read_text() + "{{- '' -}}")

    assert variant("template", template) == {"chat_template_revision"}

    def processor(c):
        cfg = json.loads((c / "preprocessor_config.json").read_text())
        cfg["image_mean"] = [0.5, 0.5, 0.5]
        (c / "preprocessor_config.json").write_text(json.dumps(cfg))

    assert variant("processor", processor) == {"processor_revision"}


def test_dtype_is_part_of_the_encoder_key(model_cache):
    fp32 = load_model(ModelConfig(model="prism-tiny-llava", cache_dir=model_cache))
    bf16 = load_model(ModelConfig(model="prism-tiny-llava", cache_dir=model_cache, dtype="bfloat16"))
    assert fp32.contract.vision_encoder_revision == bf16.contract.vision_encoder_revision
    assert fp32.contract.encoder_key != bf16.contract.encoder_key


def test_weight_hashes_are_remembered_until_a_weight_file_changes(tmp_path, model_cache, monkeypatch):
    from common.model import contract as contract_mod

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model_dir("prism-tiny-llava", model_cache), ckpt)
    cache = str(tmp_path / "cache")
    first = _contract_with_cache(ckpt, cache)
    assert list((tmp_path / "cache" / "contracts").glob("*.json"))

    def no_reading(*a, **k):
        raise AssertionError("weights were re-hashed although nothing changed")

    monkeypatch.setattr(contract_mod, "hash_tensors", no_reading)
    assert _contract_with_cache(ckpt, cache) == first
    monkeypatch.undo()

    _edit_tensor(ckpt, lambda k: k.startswith("language_model."))  # rewrites the file: new size/mtime
    changed = _contract_with_cache(ckpt, cache)
    assert changed.model_revision != first.model_revision
    assert changed.vision_encoder_revision == first.vision_encoder_revision


def _contract_with_cache(path, cache):
    return load_model(ModelConfig(model=str(path), cache_dir=cache)).contract
