"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a request → a :class:`ToolRequest` (or ``None``).

OpenAI's shapes, checked on the raw body before anything is compiled (400 ``invalid_tools`` naming the field):

- ``tools``: up to :data:`MAX_TOOLS` ``{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}``; names ``[A-Za-z0-9_-]{1,64}`` and unique; ``parameters`` a JSON Schema object (absent: a function
  that takes no arguments, ``{}``); all of it at most ``server.max_tools_bytes`` of JSON;
- ``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
  ``{"type": "function", "function": {"name": …}}`` naming one of ``tools``; anything but ``"none"`` without tools is
  a 400 (as OpenAI answers);
- ``parallel_tool_calls``: whether an answer may hold more than one call (default true).

``tools: []`` (or absent) with ``tool_choice`` absent or ``"none"`` is no tools at all. What each choice means for the
output is :mod:`common.tools.grammar`'s; the function definitions reach the prompt through the chat template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The schema of a function defined without ``parameters``: it takes none (OpenAI's reading)."""
CHOICES = ("none", "auto", "required")


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_tools", param=param)


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]
    """Its arguments' JSON Schema (:data:`NO_ARGUMENTS` when the request gave none)."""
    definition: dict[str, Any]
    """``{"type": "function", "function": {…}}`` as the request gave it: what the chat template renders."""


@dataclass(frozen=True)
class ToolRequest:
    """The request's functions and what it lets the model do with them."""

    functions: tuple[Function, ...]
    choice: str
    """``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (the answer calls :attr:`named`)."""
    named: str | None
    """The function ``tool_choice`` names (with ``choice == "function"``)."""
    parallel: bool
    """Whether one answer may hold several calls."""

    @property
    def calls_expected(self) -> bool:
        """Whether the answer may hold calls (and so is read for them): every choice but ``"none"``."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        """The definitions for the chat template's ``tools``."""
        return [f.definition for f in self.functions]

    def function(self, name: str) -> Function | None:
        return next((f for f in self.functions if f.name == name), None)


def tools_from_request(body: dict[str, Any], max_bytes: int) -> ToolRequest | None:
    """The tools a raw request ``body`` offers, or ``None`` when it offers none; ``max_bytes`` bounds their JSON."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    size = len(json.dumps(tools, ensure_ascii=False).encode())
    if size > max_bytes:
        raise _bad(f"tools is {size} bytes of JSON; the limit is {max_bytes}", "tools")
    functions = tuple(_function(tool, f"tools.{i}") for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools must not define a function name twice", "tools")
    kind, named = _choice(choice, set(names))
    return ToolRequest(functions, kind, named, parallel is not False)


def _function(tool: Any, param: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(f'{param} must be {{"type": "function", "function": {{…}}}}', param)
    spec = tool["function"]
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'", f"{param}.function.name")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.function.description must be a string", f"{param}.function.description")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = NO_ARGUMENTS
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise _bad(f"{param}.function.parameters must be a JSON Schema of an object", f"{param}.function.parameters")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.function.strict must be true or false", f"{param}.function.strict")
    definition = {"name": name, **({"description": description} if description else {})}
    definition["parameters"] = parameters
    # (arguments are always an object: a schema that leaves its type open is read as an object's)
    return Function(name, {**parameters, "type": "object"}, {"type": "function", "function": definition})


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise _bad('tool_choice must be "none", "auto", "required" or a named function', "tool_choice")
        return choice, None
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise _bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": …}}',
                   "tool_choice")  # fmt: skip
    if name not in names:
        raise _bad("tool_choice names a function that tools does not define", "tool_choice.function.name")
    return "function", name
