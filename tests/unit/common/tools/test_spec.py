"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` read from a request body: defaults, and each malformed shape
refused with a 400 naming its field."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.tools.spec import MAX_TOOLS, NO_ARGUMENTS, tools_from_request


def _tool(name="get_w", **function):
    return {"type": "function", "function": {"name": name, **function}}


def test_defaults_and_the_choices():
    assert tools_from_request({}, 1 << 16) is None
    assert tools_from_request({"tools": [], "tool_choice": "none"}, 1 << 16) is None
    req = tools_from_request({"tools": [_tool(parameters={"type": "object"}), _tool("f")]}, 1 << 16)
    assert (req.choice, req.named, req.parallel) == ("auto", None, True)
    assert req.function("f").parameters == {**NO_ARGUMENTS, "type": "object"}
    assert req.template_tools()[1] == {"type": "function", "function": {"name": "f", "parameters": NO_ARGUMENTS}}
    named = {"type": "function", "function": {"name": "auto"}}  # (a function may be called "auto")
    req = tools_from_request({"tools": [_tool("auto")], "tool_choice": named, "parallel_tool_calls": False}, 1 << 16)
    assert (req.choice, req.named, req.parallel) == ("function", "auto", False)
    assert tools_from_request({"tools": [_tool()], "tool_choice": "required"}, 1 << 16).choice == "required"
    assert not tools_from_request({"tools": [_tool()], "tool_choice": "none"}, 1 << 16).calls_expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [_tool()] * (MAX_TOOLS + 1)}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"tools": [_tool("bad name")]}, "tools.0.function.name"),
        ({"tools": [_tool("x" * 65)]}, "tools.0.function.name"),
        ({"tools": [_tool(), _tool()]}, "tools"),
        ({"tools": [_tool(parameters=[1])]}, "tools.0.function.parameters"),
        ({"tools": [_tool(parameters={"type": "string"})]}, "tools.0.function.parameters"),
        ({"tools": [_tool(description=3)]}, "tools.0.function.description"),
        ({"tools": [_tool(strict="yes")]}, "tools.0.function.strict"),
        ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "tool_choice.function.name"),
        ({"tools": [_tool()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tools": [_tool(description="d" * 70_000)]}, "tools"),
    ],
)  # fmt: skip
def test_malformed_tools_are_refused_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        tools_from_request(body, 1 << 16)
    assert info.value.code == "invalid_tools" and info.value.param == param
