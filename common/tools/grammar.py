"""What ``tool_choice`` lets the model write, as one grammar (a :class:`~common.grammar.guide.Guide` of kind ``tools``).

A call is written as the chat template's format has it (:mod:`common.model.families.tool_format`):
``<tool_call>`` ``\\n{"name":"NAME","arguments":`` ARGS ``}\\n`` ``</tool_call>``, where ARGS is compact JSON valid
against that function's ``parameters`` (embedded as the schema's own root, so its ``$ref``\\ s resolve) and the tags
are the tokenizer's single tokens when it has them (``<[id]>`` in llguidance's Lark), else their text. Several calls
are separated by one newline.

- ``required``: one or more calls, at most ``server.max_tool_calls`` (a bound, so that an answer of bounded schemas
  always ends; exactly one with ``parallel_tool_calls: false``);
- a named function: exactly one call of it;
- ``auto``: free text, then optionally calls — the text cannot open a call unconstrained (it never holds the opening
  tag, as a token or spelled out), so a call is constrained from its first token. With text tags (a tokenizer without
  them as tokens) the answer is text or calls, not both. With a ``response_format`` besides, the answer is that format
  or calls;
- ``none``: the request's ``response_format`` if any, else free text that never opens a call.

Compiled like any guide (:mod:`common.grammar.compiler`): a function whose schema cannot be served is a 400 naming
``tools`` before any stage.
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

from common.grammar.formats import JSON_OPTIONS
from common.grammar.guide import Guide
from common.tools.spec import Function, ToolRequest
from common.tools.tags import TOOL_MARKERS


@dataclass(frozen=True)
class Markers:
    """A tokenizer's call tags: their text, and their token ids when each is one token."""

    open: str = TOOL_MARKERS[0]
    close: str = TOOL_MARKERS[1]
    open_id: int | None = None
    close_id: int | None = None

    def lark(self, closing: bool) -> str:
        token = self.close_id if closing else self.open_id
        return f"<[{token}]>" if token is not None else json.dumps(self.close if closing else self.open)


def markers_for(tokenizer: Any) -> Markers:
    """The call tags of ``tokenizer`` (a Hugging Face tokenizer), as single tokens where it has them (looked up once
    per tokenizer: the ingress asks for every request with tools)."""
    try:
        return _MARKERS[tokenizer]
    except (KeyError, TypeError):  # (TypeError: a tokenizer that cannot be weakly referenced is looked up each time)
        pass
    markers = _markers(tokenizer)
    with contextlib.suppress(TypeError):
        _MARKERS[tokenizer] = markers
    return markers


_MARKERS: weakref.WeakKeyDictionary[Any, Markers] = weakref.WeakKeyDictionary()


def _markers(tokenizer: Any) -> Markers:

    def single(text: str) -> int | None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return int(ids[0]) if len(ids) == 1 else None

    return Markers(open_id=single(TOOL_MARKERS[0]), close_id=single(TOOL_MARKERS[1]))


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` at all (a template that never reads them would drop
    the definitions silently)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tool_guide(tools: ToolRequest, markers: Markers, fmt: Guide | None, max_calls: int = 16) -> Guide | None:
    """The guide for ``tools``' choice (``fmt``: the request's own output constraint, kept where it applies; at most
    ``max_calls`` calls in one answer)."""
    if tools.choice == "none":
        return fmt or _guide(f"start: TEXT?\n{_text(markers)}")
    if tools.choice == "function":
        named = tools.function(tools.named or "")
        assert named is not None  # (the spec checked the name)
        return _guide("start: call\n" + _calls([named], markers))
    many = f'calls: call ("\\n" call){{0,{max_calls - 1}}}' if tools.parallel and max_calls > 1 else "calls: call"
    rules = f"{many}\n{_calls(tools.functions, markers)}"
    if tools.choice == "required":
        return _guide(f"start: calls\n{rules}")
    if fmt is None:
        # (text then calls needs the opening tag to be a token: a text lexeme cannot end where a spelled-out tag begins,
        # so with text tags the answer is text or calls)
        start = "TEXT? calls?" if markers.open_id is not None else "TEXT | calls"
        return _guide(f"start: {start}\n{_text(markers)}\n{rules}")
    return _guide(f"start: @fmt | calls\n{rules}", _subgrammar(fmt))


def _calls(functions: tuple[Function, ...] | list[Function], markers: Markers) -> str:
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [f"call: {alternatives}"]
    for i, function in enumerate(functions):
        head = json.dumps('\n{"name":' + json.dumps(function.name) + ',"arguments":')
        schema = json.dumps({**function.parameters, "x-guidance": JSON_OPTIONS})
        tail = json.dumps("}\n")
        lines.append(f"call_{i}: {markers.lark(False)} {head} %json {schema} {tail} {markers.lark(True)}")
    return "\n".join(lines)


def _text(markers: Markers) -> str:
    """Free text that cannot open a call: bytes (a tag that is a token is not bytes) that never spell the opening tag
    either (the answer's reader would take that for a call the grammar never checked)."""
    tag = re.escape(markers.open).replace("/", "\\/")
    return f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{tag}(.|\\n)*/"


def _subgrammar(fmt: Guide) -> dict[str, Any]:
    """``fmt``'s grammar as a named part of a larger one (JSON schema and regex guides are llguidance's top-level
    JSON; a choice guide is Lark text)."""
    if fmt.grammar.lstrip().startswith("{"):
        part = dict(json.loads(fmt.grammar)["grammars"][0])
    else:
        part = {"lark_grammar": fmt.grammar}
    part["name"] = "fmt"
    return part


def _guide(lark: str, *parts: dict[str, Any]) -> Guide:
    grammar = json.dumps({"grammars": [{"name": "tools", "lark_grammar": lark}, *parts]})
    return Guide(kind="tools", grammar=grammar, param="tools")
