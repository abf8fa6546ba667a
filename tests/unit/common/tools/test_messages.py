"""A conversation with tools: the assistant's earlier calls and the tools' answers accepted in the history, rendered
by both built templates as the model writes them; a conversation without tools renders as before; the plan prices the
definitions into the prompt and refuses tools a template cannot show."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.config import ModelConfig, PrismConfig
from common.errors import InvalidRequestError
from common.model.loader import load_frontend
from common.protocol.openai import parse_chat_request
from common.stages.prompt import render_chat
from services.ingress.plan import RequestHeaders, plan

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_w", "description": "Weather", "parameters": CITY}}]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_w", "arguments": '{ "city" : "Oslo" }'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_w", "arguments": '{"city":"Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "20C"}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["prism-tiny-llava", "prism-tiny-qwen2vl"])
def frontend(request, model_cache):
    return load_frontend(ModelConfig(model=request.param, cache_dir=model_cache))


def _body(**kw):
    return {"model": "m", "messages": HISTORY, "tools": TOOLS, **kw}


def test_the_history_renders_as_the_model_writes_calls(frontend):
    req = parse_chat_request(_body())
    messages = req.template_messages()
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    text = render_chat(frontend, messages, req.tool_request.template_tools())
    calls = '<tool_call>\n{"name":"get_w","arguments":{"city":"Oslo"}}\n</tool_call>\n<tool_call>\n' \
            '{"name":"get_w","arguments":{"city":"Rome"}}\n</tool_call>'  # fmt: skip
    assert calls in text
    assert "<tool_response>\n5C\n</tool_response>\n<tool_response>\n20C\n</tool_response>" in text
    assert json.dumps(TOOLS[0]) in text and text.index("<tools>") < text.index("Weather in Oslo")
    assert "get_w" not in render_chat(frontend, messages[:1])  # (no tools: no definitions)


def test_a_conversation_without_tools_renders_as_before(frontend):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Sure?"}]  # fmt: skip
    before = {
        "llava": "USER: <image>\nWhat? ASSISTANT: A cat.</s> USER: Sure? ASSISTANT:",
        "qwen2_vl": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n"
        "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n",
    }
    assert render_chat(frontend, messages) == before[frontend.adapter.name]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": None},
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f g", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
    ],
)  # fmt: skip
def test_malformed_history_is_refused(message):
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": [message]})
    assert info.value.param.startswith("messages.0")


def test_call_arguments_nested_past_the_parser_are_a_400_and_empty_ones_are_no_arguments():
    deep = {"type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": [{"role": "assistant", "tool_calls": [deep]}]})
    assert info.value.param.startswith("messages.0")
    empty = {"type": "function", "function": {"name": "f", "arguments": ""}}
    req = parse_chat_request({"model": "m", "messages": [{"role": "assistant", "tool_calls": [empty]}]})
    assert req.template_messages()[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_logprobs_null_is_false():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": None})
    assert req.sampling(16).logprobs is None
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 3})  # fmt: skip
    assert req.sampling(16).logprobs == 3


def test_call_arguments_count_as_prompt_text():
    call = {"type": "function", "function": {"name": "f", "arguments": json.dumps({"a": "x" * 300_000})}}
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": [{"role": "assistant", "tool_calls": [call]}]})
    assert info.value.code == "text_too_long"


def test_the_plan_renders_the_definitions_and_guides_the_answer(frontend, model_cache):
    cfg = PrismConfig.model_validate({"model": {"model": frontend.served_name, "cache_dir": model_cache}})
    headers = RequestHeaders.read(lambda name: None, "key", None)
    plain = plan(cfg, frontend, "t", _body(tools=[]), headers)
    planned = plan(cfg, frontend, "t", _body(tool_choice="required"), headers)
    assert planned.tools == [TOOLS[0]] and plain.tools is None and plain.sampling.guide is None
    assert planned.vector.text_tokens > plain.vector.text_tokens + 40  # (the definitions are prompt tokens)
    assert planned.sampling.guide.kind == "tools" and planned.sampling.guide.param == "tools"
    bare = dataclasses.replace(frontend)
    object.__setattr__(bare, "tokenizer", _NoToolsTemplate(frontend.tokenizer))
    with pytest.raises(InvalidRequestError) as info:
        plan(cfg, bare, "t", _body(), headers)
    assert (info.value.code, info.value.param) == ("invalid_tools", "tools")


class _NoToolsTemplate:
    """A tokenizer whose chat template never reads ``tools`` (a real LLaVA-1.5 checkpoint's)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
