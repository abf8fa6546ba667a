"""The model contract: content revisions of everything that shapes a model's output.

Caches are only correct if their keys change whenever the thing that produced a value changes. The contract records
a content hash (sha256, hex, 16 chars) for each part of a model directory:

* ``model_revision``        — ``config.json``, ``generation_config.json`` and every weight tensor.
* ``tokenizer_revision``    — tokenizer files (vocabulary, merges, special tokens).
* ``chat_template_revision`` — the effective chat template string.
* ``processor_revision``    — image processor config + the processor class that interprets it.
* ``vision_encoder_revision`` / ``projector_revision`` — only the tensors under the family's vision-tower and
  projector prefixes, read straight from the safetensors files (dtype-agnostic; works for bf16 checkpoints).

Processor, encoder and prefix caches build their keys from these fields; responses report them as model info.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from common.model.families.base import FamilyAdapter

_CHUNK = 1 << 20
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


class ModelContract(BaseModel):
    """Revisions of one loaded model (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str
    family: str
    model_dir: str
    dtype: str
    model_revision: str
    tokenizer_revision: str
    chat_template_revision: str
    processor_revision: str
    vision_encoder_revision: str
    projector_revision: str

    @property
    def encoder_key(self) -> str:
        """What an encoder cache key must include besides the processor key."""
        return f"{self.vision_encoder_revision}:{self.projector_revision}:{self.dtype}"


def _digest(h: Any) -> str:
    return h.hexdigest()[:16]


def _hash_files(root: Path, names: Iterable[str], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for name in names:
        path = root / name
        if not path.is_file():
            continue
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return _digest(h)


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor index, offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def hash_tensors(weight_files: list[Path], select: Any) -> str:
    """Hash name, dtype, shape and bytes of every tensor whose name ``select`` accepts, in name order."""
    h = hashlib.sha256()
    entries = []
    for path in weight_files:
        header, base = _safetensors_header(path)
        entries += [(name, meta, path, base) for name, meta in header.items() if select(name)]
    for name, meta, path, base in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}|{meta['dtype']}|{meta['shape']}\0".encode())
        start, end = meta["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + start)
            left = end - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise ValueError(f"{path} is truncated")
                h.update(chunk)
                left -= len(chunk)
    return _digest(h)


def _weight_hashes(weights: list[Path], adapter: FamilyAdapter, cache_dir: Path | None) -> tuple[str, str, str]:
    """(all weights, vision tower, projector) hashes. Reading every weight byte is the one expensive part of a
    contract, and every replica of every stage loads one, so the result is kept on disk, keyed by each weight file's
    real path, size and modification time (the same staleness rule ``make`` uses) and the family's prefixes."""

    def is_projector(name: str) -> bool:
        return name.startswith(adapter.projector_prefixes)

    def is_vision(name: str) -> bool:
        return name.startswith(adapter.vision_prefixes) and not is_projector(name)

    stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    key = hashlib.sha256(json.dumps([stamp, adapter.vision_prefixes, adapter.projector_prefixes]).encode()).hexdigest()
    path = cache_dir / "contracts" / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text())
            return cached["all"], cached["vision"], cached["projector"]
        except (ValueError, KeyError):
            pass  # a torn or foreign file: recompute and overwrite it
    result = (
        hash_tensors(weights, lambda n: True),
        hash_tensors(weights, is_vision),
        hash_tensors(weights, is_projector),
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(zip(("all", "vision", "projector"), result, strict=True))))
        os.replace(tmp, path)
    return result


def build_contract(
    model_id: str,
    model_dir: Path,
    adapter: FamilyAdapter,
    chat_template: str,
    processor_class: str,
    dtype: str,
    cache_dir: Path | None = None,
) -> ModelContract:
    """Hash a model directory into its contract (weight hashes remembered under ``cache_dir`` when given)."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{model_dir} has no .safetensors weights")
    all_weights, vision, projector = _weight_hashes(weights, adapter, cache_dir)
    return ModelContract(
        model_id=model_id,
        family=adapter.name,
        model_dir=str(model_dir),
        dtype=dtype,
        model_revision=_hash_files(model_dir, ["config.json", "generation_config.json"], extra=all_weights),
        tokenizer_revision=_hash_files(model_dir, _TOKENIZER_FILES),
        chat_template_revision=_digest(hashlib.sha256(chat_template.encode())),
        processor_revision=_hash_files(model_dir, _PROCESSOR_FILES, extra=processor_class),
        vision_encoder_revision=vision,
        projector_revision=projector,
    )
