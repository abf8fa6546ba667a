"""Pickle-free byte encoding of hand-off dataclasses.

Hand-offs that leave a trusted process boundary in raw bytes (a file, a socket, a NIXL notification) are encoded
here instead of pickled: unpickling runs code, and Prism never unpickles bytes it did not produce. The format is a
numpy ``.npz`` archive (``allow_pickle=False`` on read) with one entry per array and a ``__meta__`` entry holding
UTF-8 JSON for every non-array field. Decoding is driven by the *target class's* type hints, so the bytes cannot
choose which class gets built.

Supported field types: ``np.ndarray``, ``int``/``float``/``str``/``bool``, ``Literal`` strings, tuples of ints,
nested hand-off dataclasses and tuples of them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import types
import typing
from typing import Any, TypeVar

import numpy as np

from common.errors import HandoffError

T = TypeVar("T")
_META = "__meta__"


def to_bytes(obj: Any) -> bytes:
    """Encode a hand-off dataclass."""
    arrays: dict[str, np.ndarray] = {}
    meta = _flatten(obj, "", arrays)
    arrays[_META] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def from_bytes(cls: type[T], data: bytes) -> T:
    """Decode bytes produced by :func:`to_bytes` into ``cls``; raises :class:`HandoffError` on any mismatch."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        meta = json.loads(arrays.pop(_META).tobytes().decode())
        return _build(cls, meta, "", arrays)
    except HandoffError:
        raise
    except Exception as exc:  # zipfile/json/value errors all mean the same thing to the caller
        raise HandoffError(f"cannot decode {cls.__name__} hand-off: {exc}") from exc


def _flatten(obj: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _flatten(getattr(obj, f.name), f"{prefix}{f.name}.", arrays) for f in dataclasses.fields(obj)}
    if isinstance(obj, np.ndarray):
        key = prefix.rstrip(".")
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, (tuple, list)):
        return [_flatten(v, f"{prefix}{i}.", arrays) for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _build(tp: Any, value: Any, path: str, arrays: dict[str, np.ndarray]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):  # only ``X | None``
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _build(inner, value, path, arrays)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise HandoffError(f"{path or tp.__name__}: expected an object")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        if set(value) != names:
            raise HandoffError(f"{path or tp.__name__}: fields {sorted(value)} != {sorted(names)}")
        return tp(**{n: _build(hints[n], value[n], f"{path}{n}.", arrays) for n in names})
    if tp is np.ndarray:
        key = value.get("__array__") if isinstance(value, dict) else None
        if key not in arrays:
            raise HandoffError(f"{path}: missing array")
        return arrays[key]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise HandoffError(f"{path}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{path}{i}.", arrays) for i, v in enumerate(value))
        if len(args) != len(value):
            raise HandoffError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_build(a, v, f"{path}{i}.", arrays) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise HandoffError(f"{path}: {value!r} not one of {typing.get_args(tp)}")
        return value
    if tp in (int, float, str, bool):
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise HandoffError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise HandoffError(f"{path}: unsupported field type {tp!r}")
