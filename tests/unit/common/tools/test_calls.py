"""Reading tool calls out of an answer: streamed in any pieces equals read whole; content before the calls; calls in
the grammar's form or another; a call cut short; text that only looks like a tag."""

from __future__ import annotations

import json

import pytest

from common.tools.calls import CallReader, read_answer

ONE = '<tool_call>\n{"name":"get_w","arguments":{"city":"Oslo","days":[1,2]}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name":"time_in","arguments":{"zone":"a}\\"b{"}}\n</tool_call>'


def _streamed(text: str, size: int) -> tuple[CallReader, list[dict]]:
    reader, deltas = CallReader(), []
    for i in range(0, len(text), size):
        deltas += reader.push(text[i : i + size])
    deltas += reader.finish()
    return reader, deltas


def _assembled(deltas: list[dict]) -> dict:
    """What OpenAI's SDK makes of the deltas: content concatenated, each call's fields by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("text", ["Just text, no calls.", "Let me check.\n\n" + TWO, ONE, "a < b <tool", TWO + "\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_streamed_in_any_pieces_equals_read_whole(text, size):
    whole = read_answer(text)
    reader, deltas = _streamed(text, size)
    got = _assembled(deltas)
    assert got["content"] == whole.content == reader.content
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [(c.name, c.arguments) for c in whole.calls]
    assert [c["id"] for c in got["calls"]] == [c.id for c in reader.calls]
    assert all(json.loads(c["arguments"]) for c in got["calls"])


def test_the_message_holds_the_text_before_the_calls_and_the_calls():
    reader = read_answer("Let me check.\n\n" + TWO)
    message = reader.message()
    assert message["content"] == "Let me check."  # (whitespace before the first call is not content)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_w", "time_in"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": [1, 2]}
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"zone": 'a}"b{'}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2 and reader.called
    only = read_answer(ONE).message()
    assert only["content"] is None and len(only["tool_calls"]) == 1
    plain = read_answer("no calls here").message()
    assert plain == {"role": "assistant", "content": "no calls here"}


def test_a_call_in_another_form_is_read_whole_and_one_that_is_not_json_is_text():
    spaced = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'
    reader = read_answer(spaced)
    assert [(c.name, json.loads(c.arguments)) for c in reader.calls] == [("f", {"x": 1})] and reader.called
    broken = "<tool_call>\nnot json\n</tool_call>"
    reader = read_answer(broken)
    assert reader.calls == [] and reader.content == broken


def test_a_call_cut_short_is_not_complete():
    reader = read_answer(ONE[:40])
    assert len(reader.calls) == 1 and not reader.called
    assert reader.calls[0].arguments == ONE[ONE.index('{"city"') : 40]
    head_only = read_answer('<tool_call>\n{"na')
    assert head_only.calls == [] and head_only.content == '<tool_call>\n{"na'


def test_a_call_of_a_function_not_offered_or_with_a_broken_name_is_text():
    names = frozenset({"get_w", "time_in"})
    assert [c.name for c in read_answer(TWO, names).calls] == ["get_w", "time_in"]
    other = '<tool_call>\n{"name":"rm_rf","arguments":{}}\n</tool_call>'
    reader = read_answer(other, names)
    assert reader.calls == [] and reader.content == other and not reader.called
    broken = '<tool_call>\n{"name":"a\\xq","arguments":{}}\n</tool_call>'  # (not a JSON string escape)
    reader = read_answer(broken)
    assert reader.calls == [] and reader.content == broken
    streamed = CallReader(names=names)
    pieces = [d for i in range(0, len(other), 3) for d in streamed.push(other[i : i + 3])] + streamed.finish()
    assert _assembled(pieces) == {"content": other, "calls": []}
