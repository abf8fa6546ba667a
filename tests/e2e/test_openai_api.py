"""The official ``openai`` client against the deployed Prism app: exact tokens, streaming, media, errors."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from common.media.synthetic import synthetic_image
from common.model.builder import BUILDER_VERSION
from common.protocol.sampling import SamplingParams
from common.reference.pipeline import run_request
from tests.e2e.conftest import API_KEY
from tests.mediakit import MediaServer, Route

MODEL = "prism-tiny-llava"


def _png(seed: int, size=(200, 150)) -> bytes:
    buf = io.BytesIO()
    synthetic_image(*size, seed=seed).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _reference(lm, text: str, images=(), max_tokens: int = 12) -> tuple[list[int], list[int]]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    pil = [synthetic_image(*size, seed=seed) for seed, size in images]
    out = run_request(lm, [{"role": "user", "content": content}], pil, SamplingParams(max_tokens=max_tokens))
    return list(out.prompt_token_ids), list(out.output.token_ids)


def _messages(text: str, urls=()):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def test_models_lists_the_served_model(client, prism_server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["root"].endswith(f"prism-tiny-llava-v{BUILDER_VERSION}")


def test_text_only_matches_in_process_reference(client, tiny_llava):
    ref_prompt, ref_out = _reference(tiny_llava, "Tell me about the sky.")
    r = client.chat.completions.create(
        model=MODEL,
        messages=_messages("Tell me about the sky."),
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert r.model_extra["prompt_token_ids"] == ref_prompt
    assert r.choices[0].model_extra["token_ids"] == ref_out
    assert r.usage.prompt_tokens == len(ref_prompt) and r.usage.completion_tokens == len(ref_out)
    assert r.choices[0].message.content == tiny_llava.tokenizer.decode(ref_out, skip_special_tokens=True)


def test_data_url_image_streaming_and_not(client, tiny_llava):
    ref_prompt, ref_out = _reference(tiny_llava, "Describe.", [(1, (200, 150))])
    messages = _messages("Describe.", [_data_url(_png(1))])
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert full.choices[0].model_extra["token_ids"] == ref_out
    assert full.model_extra["prompt_token_ids"] == ref_prompt

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].model_extra["token_ids"] == ref_out
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_out)
    assert chunks[-1].model_extra["prompt_token_ids"] == ref_prompt
    assert all(c.usage is None for c in chunks[:-1]), "with include_usage every other chunk has usage: null"

    # Without stream_options there is no usage chunk (as OpenAI); the last chunk is the one with the finish reason.
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"
    assert plain[-1].choices[0].model_extra["token_ids"] == ref_out
    assert plain[-1].model_extra["prompt_token_ids"] == ref_prompt


def test_http_image_from_allowed_local_server(client, tiny_llava):
    ref_prompt, ref_out = _reference(tiny_llava, "What is it?", [(2, (160, 160))])
    with MediaServer() as server:
        server.routes["/cat.png"] = Route(body=_png(2, (160, 160)), headers={"Content-Type": "image/png"})
        r = client.chat.completions.create(
            model=MODEL,
            messages=_messages("What is it?", [server.url("/cat.png")]),
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert [s.path for s in server.seen] == ["/cat.png"]
    assert r.choices[0].model_extra["token_ids"] == ref_out
    assert r.model_extra["prompt_token_ids"] == ref_prompt


@pytest.mark.parametrize(
    "url,status,code",
    [
        ("http://169.254.169.254/latest/meta-data/", 403, "media_fetch_blocked"),
        ("gopher://127.0.0.1/x", 403, "media_fetch_blocked"),
        ("data:image/png;base64,AAAA", 400, "invalid_media"),
        ("data:image/svg+xml;base64,PHN2Zy8+", 400, "invalid_media"),
    ],
)
def test_bad_media_gets_its_error(client, url, status, code):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=_messages("hi", [url]), max_tokens=4)
    assert info.value.status_code == status
    assert info.value.body["code"] == code


def test_request_errors(client, prism_server):
    base, _ = prism_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=_messages("hi"), max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_messages("hi"), max_tokens=100_000)
    assert "limit is 256" in info.value.message
    too_many = _messages("hi", [_data_url(_png(1))] * 9)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=too_many, max_tokens=4)
    assert info.value.body["code"] == "too_many_media_items"
    r = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=headers)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_api_keys(prism_server):
    base, _ = prism_server
    body = {"model": MODEL, "messages": _messages("hi"), "max_tokens": 2}
    assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models").status_code == 401


def test_tiny_deadline_is_504(prism_server):
    base, _ = prism_server
    body = {"model": MODEL, "messages": _messages("hi", [_data_url(_png(5))]), "max_tokens": 200}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Prism-Deadline-Ms": "1"}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    headers["X-Prism-Deadline-Ms"] = "abc"
    assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers).status_code == 400
