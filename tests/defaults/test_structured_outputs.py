"""Structured outputs against ``make serve`` (both tiny models, default topology) through the official ``openai``
client: ``chat.completions.parse`` with a pydantic model; a corpus of JSON schemas, streamed and not, whose replies
end with ``stop`` within 160 tokens (≥ 90 %) and validate (all that stop); vLLM's regex and choice extensions; a
schema that cannot be served refused before any stage runs."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.served import API_KEY
from tests.structured_corpus import SCHEMAS

MODELS = ("prism-tiny-llava", "prism-tiny-qwen2vl")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)


class Owner(pydantic.BaseModel):
    nick: str = pydantic.Field(max_length=10)
    pets: list[Pet] = pydantic.Field(max_length=2)


@pytest.mark.parametrize("model", MODELS)
def test_parse_with_a_pydantic_model_returns_the_parsed_object(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Who owns which pets?"}], response_format=Owner,
        max_tokens=160, temperature=0,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Owner)
    assert Owner.model_validate_json(choice.message.content) == choice.message.parsed


def _ask(client, model: str, i: int, stream: bool) -> tuple[str, str]:
    args = dict(
        model=model, messages=[{"role": "user", "content": f"Answer {i} as JSON."}], max_tokens=160, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}},
    )  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_a_corpus_of_schemas_ends_and_validates_on_both_families_streamed_and_not(client):
    cases = [(m, i, s) for m in MODELS for i in range(len(SCHEMAS)) for s in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: _ask(client, *c), cases))
    stopped = 0
    for (model, i, stream), (text, finish) in zip(cases, answers, strict=True):
        assert finish in ("stop", "length"), (model, i, stream, finish)
        if finish == "stop":
            stopped += 1
            jsonschema.validate(json.loads(text), SCHEMAS[i])  # every reply that ends is valid
    assert len(SCHEMAS) >= 20 and stopped >= 0.9 * len(cases), (stopped, len(cases))


def test_json_object_regex_and_choice(client):
    obj = client.chat.completions.create(
        model=MODELS[0], messages=[{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"},
        max_tokens=160, temperature=0,
    )  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length" and obj.usage.completion_tokens == 160
    for model in MODELS:
        regex = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A code?"}], max_tokens=40,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        )  # fmt: skip
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].message.content)
        assert regex.choices[0].finish_reason == "stop"
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=40,
            extra_body={"guided_choice": ["yes", "no", "it depends"]},
        )  # fmt: skip
        assert choice.choices[0].message.content in ("yes", "no", "it depends")


def test_a_schema_that_cannot_be_served_is_refused_before_any_stage(client, served):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 3,
                                                                             "maximum": 1}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODELS[1], messages=[{"role": "user", "content": "x"}], response_format=bad, max_tokens=8
        )
    error = info.value.body
    assert error["code"] == "invalid_response_format" and error["param"] == "response_format.json_schema.schema"
    assert "Unsatisfiable" in error["message"]
    lines = [json.loads(line) for line in served["request_log"].read_text().splitlines()]
    refused = [line for line in lines if line["code"] == "invalid_response_format"]
    assert refused and refused[-1]["status"] == 400
    names = {span["name"].split(".")[0] for span in refused[-1]["spans"]}
    assert not names & {"media", "encode", "prefill", "decode", "routing"}, names
