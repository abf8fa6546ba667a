"""The naive baseline: FastAPI + ``model.generate()`` per request, as a user would first write it.

transformers' own processor and model classes, greedy ``generate`` in a thread per request (so several requests do
run at once, each with its own full prefill and no batching across them; the request's images are decoded and
processed in that thread too, never on the event loop), torch at one thread as Prism's engines and the monolith run
(``--torch-threads``), one SSE chunk per generated token as
``generate`` produces it (:class:`TokenStreamer`; transformers' ``TextIteratorStreamer`` would hold text back to word
boundaries and make the baseline's inter-token latency look burstier than its model is), the usage chunk counting
tokens, not chunks; the tokens reach the event loop from the generating thread directly (no thread pool reads them).
Images come as data URLs. No caches, no admission control. ``make bench`` warms it up like the other servers. Its
linear layers compute as Prism's stages do (weights packed once: :mod:`common.model.linear`), so the two
differ in how they serve, not in their GEMM library.
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
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.generation.streamers import BaseStreamer

from common.model.builder import resolve_model_dir
from common.model.linear import pack_linears


def load(model: str, cache_dir: str) -> tuple[Any, Any]:
    path = resolve_model_dir(model, cache_dir)
    processor = AutoProcessor.from_pretrained(path)
    lm = AutoModelForImageTextToText.from_pretrained(path).eval()
    pack_linears(lm)  # (the same GEMM path as Prism's stages and the monolith: the comparison is of the serving)
    cfg = lm.config
    # The embedded checkpoints do not write these processor settings; a hub checkpoint carries them.
    if getattr(processor, "patch_size", 1) is None:
        processor.patch_size = cfg.vision_config.patch_size
        processor.vision_feature_select_strategy = cfg.vision_feature_select_strategy
        processor.num_additional_image_tokens = 1
    return processor, lm


def build(model: str, cache_dir: str, torch_threads: int = 1) -> FastAPI:
    # The same torch threads per model as Prism's engines and the monolith (``model.torch_threads``: 1); a request's
    # generate() runs in its own thread, so concurrent requests share the cores as their threads do.
    torch.set_num_threads(torch_threads)
    processor, lm = load(model, cache_dir)
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "naive"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        parts = [p for m in body["messages"] if not isinstance(m["content"], str) for p in m["content"]]
        if any(p["type"] not in ("image_url", "text") for p in parts):
            return JSONResponse({"error": {"message": "unsupported part", "code": "unsupported"}}, 400)
        streamer = TokenStreamer(asyncio.get_running_loop())
        # Images decoded, processed and generated from in the request's own thread: nothing but I/O on the loop.
        args = (processor, lm, body, streamer)
        threading.Thread(target=_generate, args=args, daemon=True).start()
        return StreamingResponse(_sse(streamer, processor.tokenizer, model), media_type="text/event-stream")

    return app


def _inputs(processor: Any, body: dict[str, Any]) -> Any:
    """The processor's inputs for ``body``'s messages (images as data URLs)."""
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
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": msg["role"], "content": parts})
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=images or None, text=text, return_tensors="pt")


class TokenStreamer(BaseStreamer):
    """Each token id ``generate`` produces, as it produces it (the prompt, which ``generate`` puts first, skipped),
    handed to the event loop's queue from the generating thread (no thread of the loop's pool waits on it); ``None``
    once generation ended (or failed). ``prompt_tokens`` is set before the first token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ids: asyncio.Queue[int | None] = asyncio.Queue()
        self.prompt_tokens = 0
        self._loop = loop
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._loop.call_soon_threadsafe(self.ids.put_nowait, int(token))

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self.ids.put_nowait, None)


def _generate(processor: Any, lm: Any, body: dict[str, Any], streamer: TokenStreamer) -> None:
    try:
        inputs = _inputs(processor, body)
        streamer.prompt_tokens = int(inputs["input_ids"].shape[1])
        with torch.inference_mode():
            lm.generate(**inputs, max_new_tokens=int(body.get("max_tokens", 16)), do_sample=False, streamer=streamer)
    finally:
        streamer.end()  # (generate ends it too; a second None is never read)


async def _sse(streamer: TokenStreamer, tokenizer: Any, model: str) -> AsyncIterator[str]:
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    ids: list[int] = []
    text = ""
    while True:
        token = await streamer.ids.get()
        if token is None:
            break
        ids.append(token)
        # the text of all tokens so far, less what was sent: one chunk per token (a token that only completes a
        # multi-byte character later sends its text with that later token)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        delta, text = (full[len(text) :], full) if not full.endswith("\ufffd") else ("", text)
        yield _event(rid, created, model, [{"index": 0, "delta": {"content": delta}, "finish_reason": None}])
    n, prompt_tokens = len(ids), streamer.prompt_tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
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
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's threads (Prism's engines: 1)")
    args = parser.parse_args()
    app = build(args.model, args.cache_dir, args.torch_threads)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
