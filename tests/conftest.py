"""Shared fixtures: embedded models built once per test session into a private cache directory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _load(name: str, cache: str, **kw):
    from common.config import ModelConfig
    from common.model.loader import load_model

    return load_model(ModelConfig(model=name, cache_dir=cache, **kw))


@pytest.fixture(scope="session")
def tiny_llava(model_cache):
    return _load("prism-tiny-llava", model_cache)


@pytest.fixture(scope="session")
def tiny_qwen(model_cache):
    return _load("prism-tiny-qwen2vl", model_cache)


@pytest.fixture(scope="session", params=["llava", "qwen"])
def tiny_model(request, tiny_llava, tiny_qwen):
    return tiny_llava if request.param == "llava" else tiny_qwen


def _reference(name: str, cache: str):
    """A model object of the requesting module's own, for comparisons with ``model.generate()``. The session
    fixtures are shared with engine tests, and a decode engine switches its model's attention to Prism's paged
    implementation; were that object used as the reference, a bug there would run on both sides and hide. Its
    linear layers are PyTorch's own (``cpu_linear: torch``), not the oneDNN-packed ones the stages load: the
    reference is transformers as a user runs it."""
    from common.kv.paged_attention import IMPLEMENTATION
    from common.model.linear import PackedLinear

    lm = _load(name, cache, cpu_linear="torch")
    assert lm.text_config._attn_implementation != IMPLEMENTATION
    assert not any(isinstance(m, PackedLinear) for m in lm.model.modules())
    return lm


@pytest.fixture(scope="module")
def reference_llava(model_cache):
    return _reference("prism-tiny-llava", model_cache)


@pytest.fixture(scope="module")
def reference_qwen(model_cache):
    return _reference("prism-tiny-qwen2vl", model_cache)
