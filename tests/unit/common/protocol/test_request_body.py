"""The ingress's first checks, in-process: JSON depth, shape counts, unsupported parameters refused by name, stop
strings, penalties carried into sampling — each a 4xx naming the parameter, none echoing the client's values."""

from __future__ import annotations

import json

import pytest

from common.config import PrismConfig, ServerConfig
from common.errors import InvalidRequestError, PrismError, UnsupportedParameter
from common.protocol.body import UNSUPPORTED, decode_json
from common.protocol.openai import parse_chat_request

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _refused(body, **limits) -> PrismError:
    with pytest.raises(PrismError) as info:
        parse_chat_request(body, ServerConfig(**limits))
    return info.value


@pytest.mark.parametrize("depth", [33, 200, 5000, 100_000])
def test_deep_json_is_refused_without_recursion_errors(depth):
    raw = ("[" * depth + "]" * depth).encode()
    with pytest.raises(InvalidRequestError) as info:
        decode_json(raw, 32)
    assert info.value.code == "json_too_deep"


def test_depth_at_the_limit_and_a_real_body_pass():
    assert decode_json(("[" * 32 + "]" * 32).encode(), 32)
    assert decode_json(json.dumps(BASE).encode(), 32) == BASE


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe", b"", b"nul"])
def test_not_json(raw):
    with pytest.raises(InvalidRequestError) as info:
        decode_json(raw, 32)
    assert info.value.code == "invalid_json"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ([1, 2], "invalid_json", None),
        ({**BASE, "messages": [{"role": "user", "content": "x"}] * 300}, "too_many_messages", "messages"),
        (
            {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 65}]},
            "too_many_content_parts",
            "messages.0.content",
        ),
        ({**BASE, "messages": [{"role": "user", "content": "x" * 131_073}]}, "text_too_long", "messages"),
        (
            {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 70_000}] * 2}]},
            "text_too_long",
            "messages",
        ),
        ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, "invalid_stop", "stop"),
        ({**BASE, "stop": ""}, "invalid_stop", "stop"),
        ({**BASE, "stop": ["ok", ""]}, "invalid_stop", "stop"),
        ({**BASE, "stop": "s" * 300}, "invalid_stop", "stop"),
        ({**BASE, "stop": [1]}, "invalid_request", "stop.0"),
        ({**BASE, "messages": [{"role": "user", "content": 5}]}, "invalid_request", "messages.0.content"),
        ({**BASE, "frequency_penalty": 2.5}, "invalid_request", "frequency_penalty"),
        ({**BASE, "n": 0}, "invalid_request", "n"),
        ({**BASE, "n": True}, "invalid_request", "n"),
        ({**BASE, "n": 9}, "too_many_choices", "n"),
        ({**BASE, "messages": [{"role": "developer", "content": "x"}]}, "invalid_request", "messages.0.role"),
    ],
)
def test_shape_limits_and_values(body, code, param):
    err = _refused(body)
    assert (err.http_status, err.code) == (400, code)
    assert err.param == param


def test_n_is_served_up_to_the_configured_maximum():
    assert parse_chat_request({**BASE, "n": 8}).sampling(16).n == 8
    assert parse_chat_request({**BASE, "n": None}).sampling(16).n == 1
    assert parse_chat_request({**BASE, "n": 12}, ServerConfig(max_n=12)).sampling(16).n == 12
    err = _refused({**BASE, "n": 3}, max_n=2)
    assert (err.code, err.param) == ("too_many_choices", "n") and "limit is 2" in err.message


def test_limits_are_configurable():
    assert _refused({**BASE, "messages": [{"role": "user", "content": "x"}] * 3}, max_messages=2).code == (
        "too_many_messages"
    )
    assert (
        _refused({**BASE, "messages": [{"role": "user", "content": "abc"}]}, max_text_chars=2).code == "text_too_long"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("logit_bias", {"50256": -100}),
        ("best_of", 3),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_unsupported_parameters_are_refused_by_name(name, value):
    err = _refused({**BASE, name: value})
    assert isinstance(err, UnsupportedParameter)
    assert (err.http_status, err.code, err.param) == (400, "unsupported_parameter", name)
    assert json.dumps(value) not in err.message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("functions", []),
        ("logit_bias", {}),
        ("modalities", ["text"]),
        ("audio", None),
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
    ],
)
def test_defaults_of_unsupported_parameters_are_accepted(name, value):
    assert parse_chat_request({**BASE, name: value}).model == "m"


def test_every_unsupported_parameter_has_a_case():
    covered = {"functions", "function_call"}
    covered |= {"logit_bias", "best_of", "audio", "modalities", "prediction"}
    assert covered == set(UNSUPPORTED)


def test_unknown_fields_are_tolerated_and_named_for_the_log():
    req = parse_chat_request({**BASE, "user": "u-1", "vendor_x": {"secret": 1}, "metadata": {"a": "b"}})
    assert req.ignored_fields == ["metadata", "user", "vendor_x"]
    many = {**BASE, **{f"f{i:03d}": i for i in range(40)}, "z" * 500: 1, "a secret sentence": 1}
    names = parse_chat_request(many).ignored_fields
    assert names[:16] == [f"f{i:03d}" for i in range(16)] and names[16:] == ["+26 more"]
    assert not any("secret" in n or "zzz" in n for n in names), "names that are not identifiers are only counted"


def test_ignore_eos_reaches_the_sampler_and_is_not_an_ignored_field():
    req = parse_chat_request({**BASE, "ignore_eos": True})
    assert req.sampling(16).ignore_eos and req.ignored_fields == []
    assert not parse_chat_request(BASE).sampling(16).ignore_eos
    with pytest.raises(InvalidRequestError):
        parse_chat_request({**BASE, "ignore_eos": "maybe"})


def test_penalties_reach_the_sampler():
    req = parse_chat_request({**BASE, "frequency_penalty": 0.5, "presence_penalty": -1})
    sampling = req.sampling(16)
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -1.0) and sampling.penalised


def test_default_body_limit_covers_the_media_and_text_limits():
    cfg = PrismConfig()
    base64_media = 4 * -(-cfg.media.max_request_bytes // 3)
    assert cfg.body_limit >= base64_media + cfg.server.max_text_chars
    assert cfg.body_limit < 100 << 20
    assert PrismConfig.model_validate({"server": {"max_body_bytes": 4096}}).body_limit == 4096


def test_a_width_bomb_is_refused_before_it_is_parsed(monkeypatch):
    """A 21 MB ``[{},{},…]`` (the shape that stalled every tenant 40 s) is counted on its bytes and refused without
    ``json.loads`` ever running; a body of the same size that is mostly base64 passes the count."""
    server = ServerConfig()
    bomb = b'{"model": "m", "messages": [], "x": [' + b"{}," * 7_000_000 + b"{}]}"
    parsed = []
    real = json.loads
    monkeypatch.setattr("common.protocol.body.json.loads", lambda raw: parsed.append(1) or real(raw))
    with pytest.raises(InvalidRequestError) as info:
        decode_json(bomb, server.max_json_depth, server.json_structure_limit)
    assert info.value.code == "json_too_wide" and info.value.http_status == 400 and not parsed
    image = "data:image/png;base64," + "QUJD" * 5_000_000
    legit = json.dumps(
        {**BASE, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]}
    )
    assert decode_json(legit.encode(), server.max_json_depth, server.json_structure_limit)["model"] == "m"
    assert parsed == [1]


def test_the_structure_limit_follows_the_shape_limits():
    server = ServerConfig()
    assert server.json_structure_limit == 8 * 256 * 64 + 131_072 + 4096
    assert (
        ServerConfig(max_messages=10, max_content_parts=2, max_text_chars=100).json_structure_limit == 160 + 100 + 4096
    )
    assert ServerConfig(max_json_structure=500).json_structure_limit == 500
    with pytest.raises(InvalidRequestError):
        decode_json(b"[" + b"1," * 600 + b"1]", 32, 500)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a/\\udfff"}}]}]}',
        b'{"model": "m", "\\ud83d": 1, "messages": []}',
        b'"\\udc80"',
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400(raw):
    with pytest.raises(InvalidRequestError) as info:
        decode_json(raw, 32)
    assert info.value.http_status == 400 and info.value.code == "invalid_json" and "Unicode" in info.value.message


def test_a_surrogate_pair_is_fine():
    body = decode_json(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', 32)
    assert body["messages"][0]["content"] == "\U0001f600"


def test_unknown_fields_are_capped():
    refused = _refused({**BASE, **{f"x{i}": i for i in range(65)}})
    assert refused.code == "too_many_fields" and refused.http_status == 400
    assert parse_chat_request({**BASE, **{f"x{i}": i for i in range(64)}}, ServerConfig()).model == "m"
