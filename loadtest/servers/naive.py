"""The naive baseline: FastAPI + ``model.generate()`` per request, as a user would first write it.

transformers' own processor and model classes, greedy ``generate`` with a ``TextIteratorStreamer`` in a thread per
request (so several requests do run at once, each with its own full prefill and no batching across them), SSE chunks
as the streamer yields text, a final usage chunk. Images come as data URLs. No caches, no admission control.
``python -m loadtest.servers.naive --model prism-small-llava --port 8102``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from PIL import Image
from starlette.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoModelForImageTextToText, AutoProcessor, TextIteratorStreamer

from common.model.builder import resolve_model_dir


def load(model: str, cache_dir: str) -> tuple[Any, Any]:
    path = resolve_model_dir(model, cache_dir)
    processor = AutoProcessor.from_pretrained(path)
    lm = AutoModelForImageTextToText.from_pretrained(path).eval()
    cfg = lm.config
    # The embedded checkpoints do not write these processor settings; a hub checkpoint carries them.
    if getattr(processor, "patch_size", 1) is None:
        processor.patch_size = cfg.vision_config.patch_size
        processor.vision_feature_select_strategy = cfg.vision_feature_select_strategy
        processor.num_additional_image_tokens = 1
    return processor, lm


def build(model: str, cache_dir: str) -> FastAPI:
    processor, lm = load(model, cache_dir)
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "naive"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        messages, images = [], []
        for msg in body["messages"]:
            content = msg["content"]
            if isinstance(content, str):
                messages.append({"role": msg["role"], "content": [{"type": "text", "text": content}]})
                continue
            parts = []
            for part in content:
                if part["type"] == "image_url":
                    data = part["image_url"]["url"].split(",", 1)[1]
                    images.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
                    parts.append({"type": "image"})
                elif part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    return JSONResponse({"error": {"message": "unsupported part", "code": "unsupported"}}, 400)
            messages.append({"role": msg["role"], "content": parts})
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(images=images or None, text=text, return_tensors="pt")
        streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(**inputs, max_new_tokens=int(body.get("max_tokens", 16)), do_sample=False, streamer=streamer)
        threading.Thread(target=_generate, args=(lm, kwargs), daemon=True).start()
        return StreamingResponse(
            _sse(streamer, model, int(inputs["input_ids"].shape[1])), media_type="text/event-stream"
        )

    return app


def _generate(lm: Any, kwargs: dict[str, Any]) -> None:
    with torch.inference_mode():
        lm.generate(**kwargs)


async def _sse(streamer: TextIteratorStreamer, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    rid, created, chunks = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), 0
    pieces = iter(streamer)
    while True:
        piece = await asyncio.to_thread(next, pieces, None)
        if piece is None:
            break
        if piece:
            chunks += 1
            yield _event(rid, created, model, [{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": chunks, "total_tokens": prompt_tokens + chunks}
    yield _event(rid, created, model, [], usage=usage)
    yield "data: [DONE]\n\n"


def _event(rid: str, created: int, model: str, choices: list, **extra: Any) -> str:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    return f"data: {json.dumps(body | extra)}\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.servers.naive")
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--cache-dir", default="~/.cache/prism/models")
    parser.add_argument("--port", type=int, default=8102)
    args = parser.parse_args()
    uvicorn.run(build(args.model, args.cache_dir), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
