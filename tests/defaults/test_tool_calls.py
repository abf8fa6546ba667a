"""Tool calls against ``make serve`` (both tiny models) through the official ``openai`` client: ``required`` and a
named function give ``message.tool_calls`` whose arguments validate (and ``parse`` reads them into pydantic objects),
streamed ``delta.tool_calls`` assemble into the same calls, ``finish_reason`` is ``tool_calls``; a history with
earlier calls and tool answers is served; tools that cannot be served are refused before any stage runs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.served import API_KEY

MODELS = ("prism-tiny-llava", "prism-tiny-qwen2vl")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}  # fmt: skip
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
         "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "Time in a zone", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "clock": CLOCK}
ASK = [{"role": "user", "content": "Weather in Oslo for three days, and the time in CET?"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _streamed(client, **args) -> tuple[list[tuple[str, str, str]], str, str]:
    """(id, name, arguments) of each call, the content and the finish reason, assembled from the stream's deltas the
    way OpenAI's SDK documents it (by each call's ``index``)."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", "", ""])
                entry[0] = call.id or entry[0]
                if call.function is not None:
                    entry[1] += call.function.name or ""
                    entry[2] += call.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], content, finish


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_required_and_named_calls_validate_streamed_and_not(client, model, choice):
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=160,
                temperature=0)  # fmt: skip
    completion = client.chat.completions.create(**args)
    choice0 = completion.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    calls = choice0.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
    if isinstance(choice, dict):
        assert calls[0].function.name == "clock"
    streamed, content, finish = _streamed(client, **args)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(i.startswith("call_") for i, _, _ in streamed)


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_reads_parallel_calls_into_pydantic_objects(client):
    tool = openai.pydantic_function_tool(Forecast)
    completion = client.chat.completions.parse(
        model=MODELS[1], messages=ASK, tools=[tool], tool_choice="required", max_tokens=400, temperature=0,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 16
    for call in choice.message.tool_calls:
        assert call.function.name == "Forecast" and isinstance(call.function.parsed_arguments, Forecast)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@pytest.mark.parametrize("model", MODELS)
def test_auto_answers_text_or_calls_and_a_history_with_calls_is_served(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    message = first.choices[0].message
    if first.choices[0].finish_reason == "tool_calls":
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    else:
        assert first.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "14:05"}]  # fmt: skip
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0)  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert "<tool_call>" not in second.choices[0].message.content  # (none: the answer never opens a call)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_tools_that_cannot_be_served_are_refused_before_any_stage(client, served):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODELS[0], messages=ASK, tools=bad, tool_choice="required", max_tokens=8)
    assert info.value.body["code"] == "invalid_tools" and info.value.body["param"] == "tools"
    lines = [json.loads(line) for line in served["request_log"].read_text().splitlines()]
    refused = [line for line in lines if line["code"] == "invalid_tools"]
    assert refused and refused[-1]["status"] == 400
    names = {span["name"].split(".")[0] for span in refused[-1]["spans"]}
    assert not names & {"media", "encode", "prefill", "decode", "routing"}, names
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODELS[0], messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "rm_rf"}})  # fmt: skip
    assert info.value.body["param"] == "tool_choice.function.name"
