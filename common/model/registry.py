"""Model family registry: ``config.json``'s ``model_type`` → family adapter.

Prism never guesses a family from a model's name. A directory is claimed by the adapter that lists its
``model_type``; anything else is refused with a clear :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import UnsupportedModelError
from common.model.families.base import FamilyAdapter
from common.model.families.llava import LlavaAdapter
from common.model.families.qwen2vl import Qwen2VLAdapter

FAMILIES: dict[str, FamilyAdapter] = {a.name: a for a in (LlavaAdapter(), Qwen2VLAdapter())}
_BY_MODEL_TYPE: dict[str, FamilyAdapter] = {mt: a for a in FAMILIES.values() for mt in a.model_types}


def family_for_model_type(model_type: str) -> FamilyAdapter:
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not a supported family; supported: {sorted(_BY_MODEL_TYPE)}"
        ) from None


def family_for_dir(model_dir: str | Path) -> FamilyAdapter:
    """The adapter for an HF model directory, read from its ``config.json``."""
    path = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(path.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"{model_dir} is not a Hugging Face model directory ({exc})") from exc
    return family_for_model_type(model_type)
