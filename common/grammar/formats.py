"""``response_format`` and the structured-output extensions → a :class:`~common.grammar.guide.Guide` (or ``None``).

Accepted, at most one per request (400 ``invalid_response_format`` otherwise, naming the field):

- ``response_format: {"type": "text"}`` — no constraint (OpenAI's default);
- ``response_format: {"type": "json_object"}`` — any JSON object (OpenAI's JSON mode);
- ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` — JSON valid against
  ``schema`` (constrained whether ``strict`` is true or not; without ``schema``, any JSON object);
- vLLM's extensions: ``structured_outputs: {"json" | "regex" | "choice": …}`` and the older top-level ``guided_json``,
  ``guided_regex``, ``guided_choice`` — a JSON schema, a regular expression (Rust ``regex`` syntax, matched whole),
  or a list of strings one of which is the whole answer.

Only shapes and sizes are checked here (no tokenizer): the compile check against the model is
:meth:`common.grammar.compiler.GrammarCompiler.check`.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from common.errors import InvalidRequestError
from common.grammar.guide import Guide

EXTENSION_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
"""Top-level request fields (vLLM's names) that carry a constraint besides ``response_format``."""
MAX_CHOICES = 256
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}
"""Compact JSON (no whitespace between tokens: a bounded schema terminates); unknown schema keywords are refused."""


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_response_format", param=param)


def guide_from_request(body: dict[str, Any], max_bytes: int) -> Guide | None:
    """The constraint a raw request ``body`` asks for, or ``None``; ``max_bytes`` bounds the constraint's JSON text."""
    given = [f for f in ("response_format", *EXTENSION_FIELDS) if body.get(f) is not None]
    given = [f for f in given if not (f == "response_format" and _is_text(body[f]))]
    if not given:
        return None
    if len(given) > 1:
        raise _bad(f"only one output constraint per request; got {', '.join(given)}", given[1])
    field = given[0]
    value = body[field]
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > max_bytes:
        raise _bad(f"{field} is {size} bytes of JSON; the limit is {max_bytes}", field)
    if field == "response_format":
        return _response_format(value)
    if field == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in ("json", "regex", "choice"):
            raise _bad('structured_outputs must be an object with one key: "json", "regex" or "choice"', field)
        kind, spec = next(iter(value.items()))
        return _extension(kind, spec, f"{field}.{kind}")
    return _extension(field.removeprefix("guided_"), value, field)


def _is_text(value: Any) -> bool:
    """``{"type": "text", …}``: free text, whatever else the object holds (OpenAI ignores it too)."""
    return isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: Any) -> Guide:
    if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):  # ("text": no guide)
        raise _bad('response_format.type must be "text", "json_object" or "json_schema"', "response_format.type")
    if value["type"] == "json_object":
        return Guide(kind="json_object", grammar=_json_grammar({"type": "object"}, "response_format"))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema must be an object with a name and a schema", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise _bad("response_format.json_schema.name must be a string of 1 to 64 characters",
                   "response_format.json_schema.name")  # fmt: skip
    schema = spec.get("schema", {"type": "object"})
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON Schema object", param)
    return Guide(kind="json_schema", grammar=_json_grammar(schema, param), name=name, param=param)


def _extension(kind: str, spec: Any, param: str) -> Guide:
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise _bad(f"{param} is not a JSON Schema (not JSON)", param) from None
        if not isinstance(spec, dict):
            raise _bad(f"{param} must be a JSON Schema object", param)
        return Guide(kind="json_schema", grammar=_json_grammar(spec, param), param=param)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise _bad(f"{param} must be a non-empty regular expression", param)
        return Guide(kind="regex", grammar=llguidance.LLMatcher.grammar_from_regex(spec), param=param)
    if not (isinstance(spec, list) and 1 <= len(spec) <= MAX_CHOICES and all(isinstance(c, str) and c for c in spec)):
        raise _bad(f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings", param)
    # A Lark rule of string literals (JSON-escaped): the answer is exactly one of them.
    alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(spec))
    return Guide(kind="choice", grammar=f"start: ({alternatives})", param=param)


def _json_grammar(schema: dict[str, Any], param: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError:
        raise _bad(f"{param} is not a JSON Schema object", param) from None
