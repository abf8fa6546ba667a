"""``response_format`` and the extensions → guides; the compiler's checks, cache and refusals (no client value
echoed)."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.grammar.compiler import GrammarCompiler
from common.grammar.formats import guide_from_request
from common.grammar.guide import Guide
from common.protocol.openai import parse_chat_request

SECRET = "SECRET-7f3a"


def _schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}


def _refused(body, max_bytes=1 << 16) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        guide_from_request(body, max_bytes)
    assert info.value.code == "invalid_response_format"
    return info.value


def test_each_accepted_form_gives_its_guide():
    assert guide_from_request({}, 1024) is None
    assert guide_from_request({"response_format": {"type": "text"}}, 1024) is None
    assert guide_from_request({"response_format": None, "guided_regex": None}, 1024) is None
    # {"type": "text"} is free text whatever else it holds
    assert guide_from_request({"response_format": {"type": "text", "json_schema": {"name": "n"}}}, 1024) is None
    assert guide_from_request(
        {"response_format": {"type": "text", "strict": True}, "guided_regex": "a"}, 1024
    ).param == ("guided_regex")
    assert guide_from_request({"response_format": {"type": "json_object"}}, 1024).kind == "json_object"
    schema = guide_from_request(_schema({"type": "integer"}), 1024)
    assert (schema.kind, schema.name, schema.param) == ("json_schema", "n", "response_format.json_schema.schema")
    assert guide_from_request({"structured_outputs": {"json": {"type": "integer"}}}, 1024).kind == "json_schema"
    assert guide_from_request({"guided_json": '{"type": "integer"}'}, 1024).param == "guided_json"
    assert guide_from_request({"guided_regex": "a+"}, 1024).kind == "regex"
    choice = guide_from_request({"structured_outputs": {"choice": ['say "hi"', "no"]}}, 1024)
    assert (choice.kind, choice.param) == ("choice", "structured_outputs.choice")
    # the same constraint is the same key, whichever field carried it (the compile cache's key)
    assert guide_from_request({"guided_json": {"type": "integer"}}, 1024).key == schema.key


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (_schema([1, 2]), "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"] * 257}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(body, param):
    assert _refused(body).param == param


def test_a_constraint_past_the_byte_limit_is_refused_before_it_is_compiled():
    error = _refused(_schema({"type": "string", "description": "x" * 3000}), max_bytes=2048)
    assert "the limit is 2048" in error.message


@pytest.fixture(scope="module")
def compiler(tiny_llava) -> GrammarCompiler:
    return GrammarCompiler(tiny_llava.tokenizer, int(tiny_llava.text_config.vocab_size), tiny_llava.eos_token_ids, 2)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (_schema({"type": "integer", "minimum": 9, "maximum": 1}), "Unsatisfiable"),
        (_schema({"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
        (_schema({"not": {"const": SECRET}}), 'Unimplemented keys: ["not"]'),
        (_schema({"$ref": f"#/$defs/{SECRET}"}), "does not exist"),
        ({"guided_regex": f"([{SECRET}"}, "invalid regex"),
    ],
)
def test_what_cannot_be_compiled_is_refused_with_the_reason_and_no_client_value(compiler, body, says):
    with pytest.raises(InvalidRequestError) as info:
        compiler.check(guide_from_request(body, 1 << 16))
    assert info.value.code == "invalid_response_format" and says in info.value.message
    assert SECRET not in info.value.message
    assert compiler.stats.refused >= 1


def test_compiled_grammars_are_cached_by_key_within_a_bound(compiler):
    guides = [guide_from_request({"guided_regex": f"x{i}+"}, 1024) for i in range(3)]
    before = (compiler.stats.compiles, compiler.stats.hits)
    first = compiler.matcher(guides[0])
    second = compiler.matcher(guides[0])
    assert first is not second  # each sequence its own state
    assert first.consume_token(compiler.tokenizer.tokenize_str("x0")[0]) and not second.is_error()
    assert (compiler.stats.compiles, compiler.stats.hits) == (before[0] + 1, before[1] + 1)
    compiler.matcher(guides[1])
    compiler.matcher(guides[2])  # the bound is 2: guides[0] leaves
    compiler.matcher(guides[0])
    assert compiler.stats.compiles == before[0] + 4


def test_the_request_schema_carries_the_guide_into_sampling():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"]}
    sampling = parse_chat_request(body).sampling(16)
    assert isinstance(sampling.guide, Guide) and sampling.guide.kind == "choice"
    assert parse_chat_request({**body, "guided_choice": None}).sampling(16).guide is None
    assert sampling.model_validate(sampling.model_dump()) == sampling  # (it crosses the hand-offs)
