"""The naive baseline streams one chunk per generated token and counts tokens, not text chunks (a fair baseline:
its ITL is its model's, and its token count is what ``generate`` produced)."""

from __future__ import annotations

import json

import torch
from starlette.testclient import TestClient

from loadtest.servers import naive


def test_one_chunk_per_token_and_usage_counts_generated_tokens(model_cache):
    app = naive.build("prism-tiny-llava", model_cache)
    body = {"model": "m", "max_tokens": 7, "messages": [{"role": "user", "content": "Say something."}]}
    with TestClient(app) as client:
        raw = client.post("/v1/chat/completions", json=body).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    usage = events[-1]["usage"]
    # what greedy generate() produces for the same prompt, token by token
    processor, lm = naive.load("prism-tiny-llava", model_cache)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    inputs = processor(text=processor.apply_chat_template(messages, add_generation_prompt=True), return_tensors="pt")
    with torch.inference_mode():
        out = lm.generate(**inputs, max_new_tokens=7, do_sample=False)
    generated = out.shape[1] - inputs["input_ids"].shape[1]
    assert usage["completion_tokens"] == generated == len(chunks)
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    new_ids = out[0, inputs["input_ids"].shape[1] :]
    assert text == processor.tokenizer.decode(new_ids, skip_special_tokens=True)
