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
