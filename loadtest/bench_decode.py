"""Decode benchmark: continuous-batched decode over the paged pool vs one sequence at a time.

Measured side by side in one process (these machines are shared and noisy; only ratios in one run mean much):

* ``generate``: sequential ``model.generate()`` per request (its own prefill included — as a user would run it);
* ``sequential``: the single-sequence reference decode, one request after another (prefill done beforehand);
* ``engine@B``: the :class:`DecodeEngine` with B concurrent sequences (prefill done beforehand).

Both decode sides are timed two ways, from the same points: ``seconds`` from after the KV import (the engine: after
its first step, which imports and emits the prefill's first tokens; the reference: after it yielded the first token,
its import done), ``e2e_seconds`` from handing the prefill output over (KV import included) to the last token. Tokens
are the decoded ones (the prefill's first token is not decode's work) in the same window. The headline
``decode_speedup_32_vs_sequential`` is end to end; ``decode_speedup_32_vs_sequential_steps`` is the other window.
The headline's two sides (batch 32, sequential) run ``--repeats`` times, interleaved; the headline figures are the
medians, every run's value beside them (``…_runs``), and the other numbers are those of the median run.

Roofline: a decode step must read the language model's weights once (embedding table excluded: one row per token)
and every running sequence's KV. ``achieved_bytes_per_s`` = those bytes / step time; ``memcpy_bytes_per_s`` is a
large numpy copy's read bandwidth measured in the same run (bytes copied / time); the fraction is their ratio.

Usage: ``python -m loadtest.bench_decode [--model prism-small-llava] [--tokens 32] [--repeats 3] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from common.config import ModelConfig
from common.engine.decode import DecodeEngine
from common.kv.pool import KVPool
from common.media.synthetic import synthetic_image
from common.model.loader import LoadedModel, load_model
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode_stream
from common.reference.prefill import prefill
from common.stages.encode import encode_media
from common.stages.merge import merge
from common.stages.process import process_images
from common.stages.prompt import build_prompt
from loadtest.figures import median_index

DEFAULT_OUT = Path("loadtest/results/decode.json")


def memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _requests(lm: LoadedModel, n: int, tokens: int):
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    out = []
    for i in range(n):
        images = [synthetic_image(320, 240, seed=i)]
        content = [{"type": "image"}, {"type": "text", "text": f"Describe picture number {i} in detail."}]
        media = process_images(lm, images)
        prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 8192)
        merged = merge(lm, prompt, encode_media(lm, media))
        out.append((f"r{i}", prefill(lm, merged, sampling, 16), sampling, media, content))
    return out


def _lm_weight_bytes(lm: LoadedModel) -> int:
    lang = lm.adapter.language_model(lm.model)
    embed = lang.get_input_embeddings().weight
    params = [p for p in lang.parameters() if p is not embed] + list(lm.model.lm_head.parameters())
    return sum(p.numel() * p.element_size() for p in params)


def _kv_bytes_per_token(lm: LoadedModel) -> int:
    layers, heads, dim = lm.kv_shape
    return 2 * layers * heads * dim * torch.empty((), dtype=lm.dtype).element_size()


def bench_engine(lm: LoadedModel, requests, batch: int) -> dict:
    pool = KVPool(4096, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=batch)
    e2e_start = time.perf_counter()
    for rid, pre, sampling, *_ in requests[:batch]:
        engine.submit(rid, pre, sampling)
    first = engine.step()  # imports, emits the prefill's first tokens (and may decode one more each)
    e2e_produced = sum(e.token_id is not None for e in first) - batch  # the first tokens are prefill's
    step_times, produced, kv_read = [], 0, 0
    lengths = {rid: pre.kv.num_tokens + 1 for rid, pre, *_ in requests[:batch]}
    while engine.has_work():
        kv_read += sum(lengths[r] for r in list(engine._running))
        start = time.perf_counter()
        events = engine.step()
        step_times.append(time.perf_counter() - start)
        for e in events:
            if e.token_id is not None:
                produced += 1
                lengths[e.request_id] += 1
    e2e = time.perf_counter() - e2e_start
    pool.check_no_leaks()
    total = sum(step_times)
    weights = _lm_weight_bytes(lm) * len(step_times)
    moved = weights + kv_read * _kv_bytes_per_token(lm)
    return {
        "batch": batch,
        "tokens": produced,
        "seconds": total,
        "tokens_per_s": produced / total,
        "median_step_ms": 1000 * statistics.median(step_times),
        "bytes_per_s": moved / total,
        "e2e_tokens": e2e_produced + produced,
        "e2e_seconds": e2e,
        "e2e_tokens_per_s": (e2e_produced + produced) / e2e,
    }


def bench_sequential(lm: LoadedModel, requests) -> dict:
    produced, total, e2e = 0, 0.0, 0.0
    for _, pre, sampling, *_ in requests:
        start = time.perf_counter()
        stream = decode_stream(lm, pre, sampling)
        next(stream)  # KV imported, the prefill's first token yielded: the engine's timed window starts here too
        imported = time.perf_counter()
        produced += sum(1 for _ in stream)
        end = time.perf_counter()
        total += end - imported
        e2e += end - start
    return {
        "requests": len(requests),
        "tokens": produced,
        "seconds": total,
        "tokens_per_s": produced / total,
        "e2e_seconds": e2e,
        "e2e_tokens_per_s": produced / e2e,
    }


def bench_generate(lm: LoadedModel, requests, tokens: int) -> dict:
    produced, total = 0, 0.0
    for _, pre, *_ in requests:
        ids = torch.from_numpy(pre.prompt_token_ids)[None]
        media = requests[0][3]  # same shapes for every request: pixel layout only matters for timing
        kwargs = {"pixel_values": torch.from_numpy(np.stack([m.pixel_values for m in media]))}
        if lm.contract.family == "qwen2_vl":
            kwargs = {
                "pixel_values": torch.from_numpy(np.concatenate([m.pixel_values for m in media])),
                "image_grid_thw": torch.tensor([m.grid_thw for m in media]),
                "mm_token_type_ids": (ids == lm.config.image_token_id).int(),
            }
        start = time.perf_counter()
        with torch.inference_mode():
            out = lm.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                **kwargs,
            )
        total += time.perf_counter() - start
        produced += out.shape[1] - ids.shape[1]
    return {"requests": len(requests), "tokens": produced, "seconds": total, "tokens_per_s": produced / total}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--sequential-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the b32 and sequential sides (median)")
    parser.add_argument("--cache-dir", default=ModelConfig().cache_dir)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    lm = load_model(ModelConfig(model=args.model, cache_dir=args.cache_dir, dtype=args.dtype))
    print(f"prefilling 32 requests on {lm.served_name} ({args.dtype}) …", flush=True)
    requests = _requests(lm, 32, args.tokens)
    memcpy = memcpy_bytes_per_s()
    gen = bench_generate(lm, requests[: args.sequential_requests], args.tokens)
    engine = {b: bench_engine(lm, requests, b) for b in (1, 8)}
    # The headline's two sides, run ``repeats`` times, interleaved (a slow spell of the machine hits both sides).
    runs = [
        (bench_sequential(lm, requests[: args.sequential_requests]), bench_engine(lm, requests, 32))
        for _ in range(args.repeats)
    ]
    speedups = [e["e2e_tokens_per_s"] / q["e2e_tokens_per_s"] for q, e in runs]
    rooflines = [e["bytes_per_s"] / memcpy for _, e in runs]
    seq, engine[32] = runs[median_index(speedups)]
    for b, r in engine.items():
        print(
            f"engine@{b:<2}  {r['tokens_per_s']:8.1f} tok/s after import, {r['e2e_tokens_per_s']:8.1f} end to end  "
            f"step {r['median_step_ms']:.1f} ms",
            flush=True,
        )
    print(
        f"sequential {seq['tokens_per_s']:8.1f} tok/s after import, {seq['e2e_tokens_per_s']:8.1f} end to end   "
        f"generate() {gen['tokens_per_s']:8.1f} tok/s",
        flush=True,
    )
    result = {
        "benchmark": "decode",
        "model": lm.served_name,
        "dtype": args.dtype,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads()},
        "decode_speedup_32_vs_sequential": speedups[median_index(speedups)],
        "decode_speedup_32_vs_sequential_runs": speedups,
        "decode_speedup_32_vs_sequential_steps": engine[32]["tokens_per_s"] / seq["tokens_per_s"],
        "decode_speedup_32_vs_generate": engine[32]["tokens_per_s"] / gen["tokens_per_s"],
        "decode_roofline_fraction_b32": rooflines[median_index(rooflines)],
        "decode_roofline_fraction_b32_runs": rooflines,
        "engine_b32_bytes_per_s_runs": [e["bytes_per_s"] for _, e in runs],
        "memcpy_bytes_per_s": memcpy,
        "lm_weight_bytes": _lm_weight_bytes(lm),
        "sequential": seq,
        "generate": gen,
        "engine": {str(b): r for b, r in engine.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out.resolve())
    return result


if __name__ == "__main__":
    main()
