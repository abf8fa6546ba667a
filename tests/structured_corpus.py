"""JSON schemas for the structured-output tests: each bounded (strings with ``maxLength``, numbers with ranges,
arrays with ``maxItems``), so a reply constrained by it can end within a small ``max_tokens`` — the shapes
applications send: nested objects, arrays with bounds, enums, numbers with ranges, ``anyOf``, ``$ref``, ``const``."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "maxLength": 12}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": _NAME, "age": _SMALL}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": _SMALL, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object",
     "properties": {"user": {"type": "object", "properties": {"id": _SMALL, "nick": _NAME}, "required": ["id", "nick"],
                             "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["score"],
     "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"value": {"anyOf": [_NAME, _SMALL, {"type": "null"}]}}, "required": ["value"],
     "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": _SMALL, "y": _SMALL}, "required": ["x", "y"],
                         "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "string", "maxLength": 16},
    {"enum": ["yes", "no", "unsure"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1,
                                                                            "maximum": 31}},
     "required": ["kind", "day"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": _NAME}, "required": ["k"],
                                "additionalProperties": False}, "maxItems": 2},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["ratio"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}, "done": {"type": "boolean"},
                                      "priority": {"enum": [1, 2, 3]}},
     "required": ["title", "done", "priority"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "array", "items": _SMALL, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
    {"$defs": {"node": {"type": "object", "properties": {"v": _SMALL, "next": {"anyOf": [{"type": "null"},
                                                                                        {"$ref": "#/$defs/leaf"}]}},
                        "required": ["v", "next"], "additionalProperties": False},
               "leaf": {"type": "object", "properties": {"v": _SMALL}, "required": ["v"],
                        "additionalProperties": False}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1000, "maximum": 9999}, "labels": {
        "type": "array", "items": _NAME, "maxItems": 2}}, "required": ["id", "labels"], "additionalProperties": False},
]  # fmt: skip
