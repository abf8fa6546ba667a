"""What each ``tool_choice`` lets the model write, checked token by token against the built tokenizers, and greedy
decoding under it: ``required`` and a named function give calls whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.errors import InvalidRequestError
from common.grammar.compiler import compiler_for
from common.grammar.formats import guide_from_request
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.merge import merge
from common.stages.prompt import build_prompt
from common.tools.calls import read_answer
from common.tools.grammar import Markers, markers_for, renders_tools, tool_guide
from common.tools.spec import tools_from_request

WEATHER = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/city"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"city": {"type": "string", "maxLength": 6}},
}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time_in", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "time_in": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{args}}}\n</tool_call>'


W = _call("get_weather", '{"city":"Oslo","unit":"C"}')
T = _call("time_in", '{"zone":-3}')


def _guide(lm, choice="auto", parallel=True, fmt=None, markers=None, max_calls=16):
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel, **(fmt or {})}
    tools = tools_from_request(body, 1 << 16)
    return tool_guide(tools, markers or markers_for(lm.tokenizer), guide_from_request(body, 1 << 16), max_calls)


def _accepts(lm, guide, text: str) -> bool:
    matcher = compiler_for(lm).matcher(guide)
    for token in lm.tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_the_built_tokenizers_have_the_tags_as_tokens_and_templates_that_render_tools(tiny_model):
    markers = markers_for(tiny_model.tokenizer)
    assert markers.open_id is not None and markers.close_id is not None and markers.open_id != markers.close_id
    assert renders_tools(tiny_model.tokenizer)
    ids = tiny_model.tokenizer(W, add_special_tokens=False)["input_ids"]
    assert tiny_model.tokenizer.decode(ids, skip_special_tokens=True) == W  # (plain tokens: kept in the text)


def test_required_and_named(tiny_model):
    lm = tiny_model
    required = _guide(lm, "required")
    assert _accepts(lm, required, W) and _accepts(lm, required, W + "\n" + T)
    assert not _accepts(lm, required, "Sure.")
    assert not _accepts(lm, required, _call("get_weather", '{"city":"Stockholm","unit":"C"}'))  # maxLength via $ref
    assert not _accepts(lm, required, _call("get_weather", '{"city":"Oslo"}'))  # required property
    assert not _accepts(lm, required, _call("get_weather", '{"city": "Oslo","unit":"C"}'))  # compact
    assert not _accepts(lm, required, _call("time_in", '{"zone":20}'))
    assert not _accepts(lm, required, _call("nope", "{}"))
    single = _guide(lm, "required", parallel=False)
    assert _accepts(lm, single, W) and not _accepts(lm, single, W + "\n" + T)
    two = _guide(lm, "required", max_calls=2)
    assert _accepts(lm, two, W + "\n" + T) and not _accepts(lm, two, W + "\n" + T + "\n" + W)
    named = _guide(lm, {"type": "function", "function": {"name": "time_in"}})
    assert _accepts(lm, named, T) and not _accepts(lm, named, W) and not _accepts(lm, named, T + "\n" + T)


def _spelled(lm, text: str) -> list[int]:
    """Token ids that write ``text`` with the call tags spelled out in ordinary tokens (never the tag tokens)."""
    pieces = text.replace("<tool_call>", "<\x00tool_call>").replace("</tool_call>", "</\x00tool_call>").split("\x00")
    return [t for p in pieces for t in lm.tokenizer(p, add_special_tokens=False)["input_ids"]]


def _accepts_ids(lm, guide, ids: list[int]) -> bool:
    matcher = compiler_for(lm).matcher(guide)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_auto_is_text_or_calls_and_a_call_is_constrained_from_its_first_token(tiny_model):
    lm = tiny_model
    auto = _guide(lm)
    assert _accepts(lm, auto, "Plain words.") and _accepts(lm, auto, "Checking.\n" + W) and _accepts(lm, auto, W)
    assert not _accepts(lm, auto, '<tool_call>\n{"name":"rm_rf","arguments":{}}\n</tool_call>')
    # A tag spelled out in ordinary tokens is not free text (the reader would take it for an unchecked call).
    spelled = _spelled(lm, "Checking.\n" + _call("rm_rf", "{}"))
    assert markers_for(lm.tokenizer).open_id not in spelled and not _accepts_ids(lm, auto, spelled)
    assert not _accepts_ids(lm, _guide(lm, "none"), _spelled(lm, "x <tool_call> y"))
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": TIME}}}
    either = _guide(lm, fmt=fmt)
    assert _accepts(lm, either, '{"zone":3}') and _accepts(lm, either, T) and not _accepts(lm, either, "words")


def test_none_never_opens_a_call_and_keeps_the_response_format(tiny_model):
    lm = tiny_model
    none = _guide(lm, "none")
    assert _accepts(lm, none, "Plain words.") and not _accepts(lm, none, W)
    fmt = {"response_format": {"type": "json_object"}}
    assert _guide(lm, "none", fmt=fmt) == guide_from_request(fmt, 1 << 16)


def test_text_tags_compile_and_a_bad_parameters_schema_is_refused_naming_tools(tiny_llava):
    """With text tags (a tokenizer without them as tokens) ``auto`` is text or calls; a bad schema names ``tools``."""
    lm = tiny_llava
    for choice in ("auto", "required", "none"):
        compiler_for(lm).check(_guide(lm, choice, markers=Markers()))
    auto = _guide(lm, markers=Markers())
    assert _accepts_ids(lm, auto, _spelled(lm, W + "\n" + T)) and _accepts_ids(lm, auto, _spelled(lm, "Plain."))
    assert not _accepts_ids(lm, auto, _spelled(lm, "Plain <tool_call> words"))
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}]  # fmt: skip
    guide = tool_guide(tools_from_request({"tools": bad, "tool_choice": "required"}, 1 << 16), Markers(), None)
    with pytest.raises(InvalidRequestError) as info:
        compiler_for(tiny_llava).check(guide)
    assert info.value.param == "tools" and "tools' parameters" in info.value.message


@pytest.mark.parametrize(
    ("choice", "parallel", "most"),
    [("required", False, 1), ("required", True, 3), (NAMED, True, 1)],
)
def test_greedy_decoding_under_required_or_named_calls_with_valid_arguments(tiny_model, choice, parallel, most):
    """Random weights end an answer of calls only where the grammar leaves nothing else: after one call, or after the
    most that ``max_tool_calls`` allows."""
    lm = tiny_model
    guide = _guide(lm, choice, parallel, max_calls=3)
    messages = [{"role": "user", "content": "What is the weather in Oslo, and the time?"}]
    prompt = build_prompt(lm, messages, [], 4096, TOOLS)
    assert "get_weather" in lm.tokenizer.decode(prompt.token_ids)  # (the template rendered the definitions)
    sampling = SamplingParams(max_tokens=200, guide=guide)
    out = decode(lm, prefill(lm, merge(lm, prompt, []), sampling, 16), sampling)
    assert out.finish_reason == "stop"
    reader = read_answer(lm.tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert reader.called and reader.content == "" and 1 <= len(reader.calls) <= most
    for call in reader.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if isinstance(choice, dict):
        assert [c.name for c in reader.calls] == ["get_weather"]
