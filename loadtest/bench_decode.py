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

Roofline (:mod:`loadtest.roofline`): each step's floor is the larger of its memory floor (weights and KV at the
engine's measured read bandwidth) and its compute floor (its FLOPs at the machine's GEMM peak), both measured in the
same run; ``decode_roofline_fraction_b32`` is that floor over the mean b32 step. Beside it, ``b32_weight_gemm_ms`` and
the rate the weight GEMMs reach on 32 rows. The speedup against Prism's own engine at batch 1
(``decode_speedup_32_vs_engine_b1``: the same requests one after another through the engine, end to end) runs
interleaved with the headline's two sides.

Per dtype (``--dtypes``, default fp32 then bf16; the headline figures are the first's): step time, bytes read per step,
its memory and compute floors and fraction of the roofline, and speedup over sequential at batch 1/8/32; where the
native kernel takes the dtype (fp32, bf16), the batch-32 step again on PyTorch's per-sequence attention
(``native_attention`` off: what :mod:`common.kv.native` buys; one run of its own, after the headline's, beside the
median headline run's step); the greedy tokens' agreement of the engine at batch 32 with ``generate()`` and with the
engine at batch 1 (fp32: must be 1.0 — the tests hold it; bf16: GEMM blocking changes with batch size, so it is
reported, not promised); and prefill: the reference ``prefill()`` of each whole prompt (288 tokens: one forward pass, as
one engine chunk of ≤ 512 tokens computes it; its KV export included) timed against its FLOPs (weights + causal
attention) and the GEMM rate ``gemm_flops_per_s``.

Usage: ``python -m loadtest.bench_decode [--model prism-small-llava] [--tokens 32] [--repeats 3] [--dtypes
float32,bfloat16] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
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
from loadtest import machine
from loadtest.figures import median_index
from loadtest.roofline import (
    gemm_flops_per_token,
    kv_bytes_per_token,
    linear_path,
    lm_weight_bytes,
    memcpy_bytes_per_s,
    read_probes,
    roofline,
    serial_floor_ms,
    step_floor_ms,
    timed,
    weight_gemm_seconds,
)

DEFAULT_OUT = Path("loadtest/results/decode.json")


def _requests(lm: LoadedModel, n: int, tokens: int):
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    out = []
    for i in range(n):
        images = [synthetic_image(320, 240, seed=i)]
        content = [{"type": "image"}, {"type": "text", "text": f"Describe picture number {i} in detail."}]
        media = process_images(lm, images)
        prompt = build_prompt(lm, [{"role": "user", "content": content}], media, 8192)
        merged = merge(lm, prompt, encode_media(lm, media))
        out.append((f"r{i}", prefill(lm, merged, sampling, 16), sampling, media, merged))
    return out


def bench_engine(lm: LoadedModel, requests, batch: int, native: bool = True) -> dict:
    pool = KVPool(4096, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=batch, native_attention=native)
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests[:batch]}
    e2e_start = time.perf_counter()
    for rid, pre, sampling, *_ in requests[:batch]:
        engine.submit(rid, pre, sampling)
    attending = _AttentionClock(engine)
    first = engine.step()  # imports, emits the prefill's first tokens (and may decode one more each)
    attending.reset()  # (the timed steps' attention only)
    e2e_produced = sum(e.token_id is not None for e in first) - batch  # the first tokens are prefill's
    for e in first:
        tokens[e.request_id].append(e.token_id)
    step_times, produced, kv_read, rows = [], 0, 0, 0
    lengths = {rid: pre.kv.num_tokens + 1 for rid, pre, *_ in requests[:batch]}
    while engine.has_work():
        kv_read += sum(lengths[rid] for rid, _ in list(engine._running))
        rows += len(engine._running)
        start = time.perf_counter()
        events = engine.step()
        step_times.append(time.perf_counter() - start)
        for e in events:
            if e.token_id is not None:
                produced += 1
                lengths[e.request_id] += 1
                tokens[e.request_id].append(e.token_id)
    e2e = time.perf_counter() - e2e_start
    attending.stop()
    split, attention_s = attending.layer_split(), attending.seconds
    pool.check_no_leaks()
    total = sum(step_times)
    weights = lm_weight_bytes(lm) * len(step_times)
    moved = weights + kv_read * kv_bytes_per_token(lm)
    layers, _, dim = lm.kv_shape
    flops = rows * gemm_flops_per_token(lm) + layers * 4 * lm.text_config.num_attention_heads * dim * kv_read
    return {
        "batch": batch,
        "native_attention": engine.kernel is not None,
        "tokens": produced,
        "seconds": total,
        "tokens_per_s": produced / total,
        "median_step_ms": 1000 * statistics.median(step_times),
        "bytes_per_step": moved / len(step_times),
        "bytes_per_s": moved / total,
        "steps": len(step_times),
        "flops_per_step": flops / len(step_times),
        # (the KV's share of the bytes, and the attention's of the FLOPs: the serial floor's two phases)
        "kv_bytes_per_step": kv_read * kv_bytes_per_token(lm) / len(step_times),
        "attention_flops_per_step": (flops - rows * gemm_flops_per_token(lm)) / len(step_times),
        "e2e_tokens": e2e_produced + produced,
        "e2e_seconds": e2e,
        "e2e_tokens_per_s": (e2e_produced + produced) / e2e,
        # the attention kernel's share: its mean time per step and the rate it reads the step's KV at
        "attention_ms_per_step": 1000 * attention_s / len(step_times) if engine.kernel else None,
        "attention_kv_bytes_per_s": kv_read * kv_bytes_per_token(lm) / attention_s if engine.kernel else None,
        # where the decoder layers ran in one foreign call (common/engine/decode_layers.py): each kernel's mean time
        # per step (over the layers), and the rest of the mean step (embedding, rotary, LM head, sampling, Python)
        "layer_kernels_ms_per_step": {k: 1000 * s / len(step_times) for k, s in split.items()},
        "outside_layer_kernels_ms_per_step": (
            1000 * (total - sum(split.values())) / len(step_times) if attending.chain else None
        ),
        "_tokens": tokens,
    }


class _AttentionClock:
    """Times the native attention kernel's calls of one engine: those from Python (its ``attend`` and ``rope_attend``
    — the lean forward's call, which also rotates the new query and key heads and writes the new KV rows — wrapped on
    the shared kernel object until :meth:`stop`) and those the decoder-layer driver makes from C (its own clock:
    :attr:`common.engine.decode_layers.DecodeLayers.seconds`)."""

    CALLS = ("attend", "rope_attend")

    def __init__(self, engine: DecodeEngine):
        self.kernel, self.wrapped = engine.kernel, 0.0
        self.chain = engine.forward.chain if engine.forward is not None else None
        self.reset()
        if self.kernel is None:
            return
        for name in self.CALLS:
            setattr(self.kernel, name, self._timed(getattr(self.kernel, name)))

    def reset(self) -> None:
        self.wrapped, self._chain_from = 0.0, dict(self.chain.seconds) if self.chain is not None else {}

    def layer_split(self) -> dict[str, float]:
        """The driver's seconds in each kernel since :meth:`reset` (none without the driver)."""
        if self.chain is None:
            return {}
        return {k: s - self._chain_from[k] for k, s in self.chain.seconds.items()}

    @property
    def seconds(self) -> float:
        return self.wrapped + self.layer_split().get("attention", 0.0)

    def _timed(self, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.wrapped += time.perf_counter() - start

        return timed

    def stop(self) -> None:
        if self.kernel is not None:
            for name in self.CALLS:
                delattr(self.kernel, name)  # (the class's method again)


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


def bench_engine_one_by_one(lm: LoadedModel, requests) -> dict:
    """Prism's engine at batch 1: the requests one after another, each timed end to end as :func:`bench_engine`
    times its batch (KV import included); their tokens, for the agreement figures."""
    runs = [bench_engine(lm, [request], 1) for request in requests]
    tokens = sum(r["e2e_tokens"] for r in runs)
    seconds = sum(r["e2e_seconds"] for r in runs)
    said = {rid: ids for r in runs for rid, ids in r["_tokens"].items()}
    return {"requests": len(runs), "e2e_tokens_per_s": tokens / seconds, "_tokens": said}


def bench_generate(lm: LoadedModel, requests, tokens: int) -> dict:
    produced, total, said = 0, 0.0, {}
    for rid, pre, _, media, _ in requests:
        ids = torch.from_numpy(pre.prompt_token_ids)[None]
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
        said[rid] = out[0, ids.shape[1] :].tolist()
    return {
        "requests": len(requests),
        "tokens": produced,
        "seconds": total,
        "tokens_per_s": produced / total,
        "_tokens": said,
    }


def agreement(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict:
    """Over the requests both sides ran: the share that are token-identical, and the mean share of each answer
    before the first differing token (greedy: after one difference the two continue from different text)."""
    common = [rid for rid in want if rid in got]
    prefix = []
    for rid in common:
        a, b = got[rid], want[rid]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), len(b), 1))
    return {
        "requests": len(common),
        "identical": sum(got[r] == want[r] for r in common) / max(len(common), 1),
        "mean_prefix_fraction": statistics.fmean(prefix) if prefix else 0.0,
    }


def bench_prefill(lm: LoadedModel, requests, peak: float) -> dict:
    """The reference prefill of each whole prompt (one forward pass, KV export included; the bench's prompts fit one
    512-token engine chunk), timed against its FLOPs."""
    layers, _, dim = lm.kv_shape
    q_heads = lm.text_config.num_attention_heads
    seconds, flops, tokens = 0.0, 0, 0
    for _, pre, sampling, _, merged in requests:
        n = pre.kv.num_tokens
        seconds += timed(lambda merged=merged, sampling=sampling: prefill(lm, merged, sampling, 16))
        # weight GEMMs for every token (lm_head only for the last) + causal attention: QK^T and PV over n(n+1)/2 pairs
        head = 2 * lm.model.lm_head.weight.numel()
        flops += (gemm_flops_per_token(lm) - head) * n + head + layers * 4 * q_heads * dim * n * (n + 1) // 2
        tokens += n
    return {
        "requests": len(requests),
        "tokens_per_chunk": tokens / len(requests),
        "ms_per_chunk": 1000 * seconds / len(requests),
        "flops_per_s": flops / seconds,
        "gemm_flops_per_s": peak,
        "fraction_of_gemm_peak": flops / seconds / peak,
    }


def dtype_figures(lm: LoadedModel, tokens: int, sequential_requests: int, repeats: int) -> dict:
    """Every decode and prefill figure of one dtype, measured side by side in this process."""
    print(f"prefilling 32 requests on {lm.served_name} ({lm.dtype}) …", flush=True)
    requests = _requests(lm, 32, tokens)
    memcpy, reads = memcpy_bytes_per_s(), read_probes()
    read = max(reads.values())  # (the machine reads at the faster: loadtest/roofline.py)
    gemm_ms, gemm_ms_onednn, gemm_ms_torch = (
        1000 * weight_gemm_seconds(lm, 32, **path) for path in ({}, {"onednn": True}, {"stock": True})
    )
    # The peak: the faster of the model's own path (oneDNN, packed) and PyTorch's F.linear on 512 rows.
    peak = 512 * gemm_flops_per_token(lm) / min(weight_gemm_seconds(lm, 512, 3, stock) for stock in (False, True))
    gen = bench_generate(lm, requests[:sequential_requests], tokens)
    engine = {b: bench_engine(lm, requests, b) for b in (1, 8)}
    # The headline's sides, run ``repeats`` times, interleaved (a slow spell of the machine hits every side): the
    # reference decode one request at a time, Prism's engine at batch 1 over the same requests, the engine at 32.
    runs = [
        (
            bench_sequential(lm, requests[:sequential_requests]),
            bench_engine_one_by_one(lm, requests[:sequential_requests]),
            bench_engine(lm, requests, 32),
        )
        for _ in range(repeats)
    ]
    speedups = [e["e2e_tokens_per_s"] / q["e2e_tokens_per_s"] for q, _, e in runs]
    vs_b1 = [e["e2e_tokens_per_s"] / one["e2e_tokens_per_s"] for _, one, e in runs]
    rooflines = [roofline(e, read, peak)["floor_fraction"] for _, _, e in runs]
    seq, alone, engine[32] = runs[median_index(speedups)]
    torch_path = bench_engine(lm, requests, 32, native=False) if engine[32]["native_attention"] else None
    gemm_and_attention_ms = gemm_ms + (engine[32]["attention_ms_per_step"] or 0.0)
    floor_b1, floor_b32 = (step_floor_ms(engine[b], read, peak) for b in (1, 32))
    serial_b32 = serial_floor_ms(engine[32], read, peak)
    _say(engine, seq, gen, torch_path, read, peak)
    return {
        "dtype": str(lm.dtype).removeprefix("torch."),
        "decode_speedup_32_vs_sequential": speedups[median_index(speedups)],
        "decode_speedup_32_vs_sequential_runs": speedups,
        "decode_speedup_32_vs_sequential_steps": engine[32]["tokens_per_s"] / seq["tokens_per_s"],
        "decode_speedup_32_vs_engine_b1": vs_b1[median_index(vs_b1)],
        "decode_speedup_32_vs_engine_b1_runs": vs_b1,
        "decode_speedup_32_vs_generate": engine[32]["tokens_per_s"] / gen["tokens_per_s"],
        "decode_roofline_fraction_b32": rooflines[median_index(rooflines)],
        "decode_roofline_fraction_b32_runs": rooflines,
        "engine_b32_bytes_per_s_runs": [e["bytes_per_s"] for _, _, e in runs],
        "read_bytes_per_s": read,
        "read_bytes_per_s_by_pages": reads,
        "memcpy_bytes_per_s": memcpy,
        "gemm_flops_per_s": peak,
        "torch_threads": torch.get_num_threads(),
        "lm_weight_bytes": lm_weight_bytes(lm),
        "per_batch": {
            str(b): {
                "median_step_ms": r["median_step_ms"],
                "bytes_per_step": r["bytes_per_step"],
                "flops_per_step": r["flops_per_step"],
                **roofline(r, read, peak),
                "copy_floor_fraction": r["bytes_per_s"] / memcpy,  # (the figure's definition before 2026-12-03)
                "speedup_vs_sequential": r["e2e_tokens_per_s"] / seq["e2e_tokens_per_s"],
                "attention_ms_per_step": r["attention_ms_per_step"],
                "attention_kv_bytes_per_s": r["attention_kv_bytes_per_s"],
            }
            for b, r in engine.items()
        },
        # the b32 step's weight GEMMs alone, and the rate they run at on 32 rows (the peak is on 512)
        "b32_weight_gemm_ms": gemm_ms,
        "b32_weight_gemm_flops_per_s": 32 * gemm_flops_per_token(lm) / (gemm_ms / 1000),
        # the same GEMMs through oneDNN on the packed weights (what the row kernel buys in fp32; the same path in
        # bf16), and through PyTorch's own F.linear (MKL in fp32): what packing buys
        "b32_weight_gemm_ms_onednn": gemm_ms_onednn,
        "b32_weight_gemm_ms_torch": gemm_ms_torch,
        # What the roofline fraction could be if the step did nothing but its weight GEMMs (each layer on its own, as
        # timed above) and its attention kernel (as timed in the step), one after the other: the evidence for how
        # far the rest of the step (norms, rotary, residuals, KV writes, sampling, dispatch) keeps it from the target.
        "b32_gemm_plus_attention_ms": gemm_and_attention_ms,
        "b32_fraction_if_nothing_else": floor_b32 / gemm_and_attention_ms,
        # What the floors themselves allow (loadtest/roofline.py): the roofline fraction of a step that reads and
        # computes at the machine's measured rates but runs its weight GEMMs and its attention one after the other,
        # as a layer's data dependencies make the engine do (a ceiling for the b32 step); and the speedup at 32 over
        # batch 1 were both steps at their floors (not a ceiling of the end-to-end figure, which also counts each
        # request's KV import: batch 32 overlaps the imports, batch 1 waits for each).
        "b32_serial_floor_ms": serial_b32,
        "decode_roofline_fraction_b32_serial_ceiling": floor_b32 / serial_b32,
        "decode_speedup_32_vs_b1_at_floors": 32 * floor_b1 / floor_b32,
        "b32_layer_kernels_ms_per_step": engine[32]["layer_kernels_ms_per_step"],
        "b32_outside_layer_kernels_ms_per_step": engine[32]["outside_layer_kernels_ms_per_step"],
        "linear_path": linear_path(lm),
        "attention_paths_b32_step_ms": {
            "native": engine[32]["median_step_ms"] if engine[32]["native_attention"] else None,
            "pytorch": (torch_path or engine[32])["median_step_ms"],
        },
        "agreement_greedy": {
            "b32_vs_generate": agreement(engine[32]["_tokens"], gen["_tokens"]),
            "b32_vs_b1": agreement(engine[32]["_tokens"], alone["_tokens"]),
            "b1_vs_generate": agreement(alone["_tokens"], gen["_tokens"]),
        },
        "prefill": bench_prefill(lm, requests[:sequential_requests], peak),
        "sequential": seq,
        "generate": {k: v for k, v in gen.items() if not k.startswith("_")},
        "engine": {str(b): {k: v for k, v in r.items() if not k.startswith("_")} for b, r in engine.items()},
    }


def _say(engine: dict, seq: dict, gen: dict, torch_path: dict | None, read: float, peak: float) -> None:
    for b, r in engine.items():
        line = roofline(r, read, peak)
        print(
            f"engine@{b:<2}  {r['tokens_per_s']:8.1f} tok/s after import, {r['e2e_tokens_per_s']:8.1f} end to end  "
            f"step {r['median_step_ms']:.1f} ms  {line['floor_fraction']:.2f} of the roofline ({line['bound']})",
            flush=True,
        )
    if torch_path:
        print(f"engine@32 on PyTorch's per-sequence attention: step {torch_path['median_step_ms']:.1f} ms", flush=True)
    print(
        f"sequential {seq['tokens_per_s']:8.1f} tok/s after import, {seq['e2e_tokens_per_s']:8.1f} end to end   "
        f"generate() {gen['tokens_per_s']:8.1f} tok/s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; the headline is the first's")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--sequential-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the b32 and sequential sides (median)")
    parser.add_argument("--cache-dir", default=ModelConfig().cache_dir)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    per_dtype = {}
    for i, dtype in enumerate(dtypes):
        lm = load_model(ModelConfig(model=args.model, cache_dir=args.cache_dir, dtype=dtype))
        # the headline dtype runs ``repeats`` times; the others once (they are reported, not targets)
        per_dtype[dtype] = dtype_figures(lm, args.tokens, args.sequential_requests, args.repeats if i == 0 else 1)
    head = per_dtype[dtypes[0]]
    result = {
        "benchmark": "decode",
        "model": args.model,
        "dtype": dtypes[0],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine.facts(),
        **{k: v for k, v in head.items() if k != "dtype"},
        "dtypes": {
            d: {k: v for k, v in f.items() if k not in ("sequential", "generate", "engine")}
            for d, f in per_dtype.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out.resolve())
    return result


if __name__ == "__main__":
    main()
