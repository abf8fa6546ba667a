"""Structured-output benchmark: what grammar masks cost a batched decode step.

Two measurements, side by side in one process:

* **on the model** (``--model``, default ``prism-small-llava``): the :class:`DecodeEngine` at batch ``--batch`` (32)
  with every sequence under a JSON schema (a string of 64–400 characters: every sequence keeps running) against the
  same prompts with none; the median step time of each over the steps where the whole batch runs, the engine's own
  mask time per constrained step (filling the masks and applying them), and their ratio to the free step;
* **at a real-size vocabulary**: a byte-level BPE tokenizer of 151,100 tokens built here (Qwen2's vocabulary is
  151,646; no hub is reachable) — the masks of ``--batch`` matchers advancing through the same schema, filled and
  applied to ``[batch, 151100]`` logits, per step; reported beside the model's free step (a model with a vocabulary
  that size has a far larger step: the fraction is an upper bound).

Usage: ``python -m loadtest.bench_grammar [--model prism-small-llava] [--batch 32] [--steps 24] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import string
import time
from datetime import UTC, datetime
from pathlib import Path

import llguidance
import llguidance.hf
import torch

from common.config import ModelConfig
from common.engine.decode import DecodeEngine
from common.grammar.formats import guide_from_request
from common.grammar.masks import MaskBuffer, apply_masks
from common.kv.pool import KVPool
from common.model.loader import LoadedModel, load_model
from common.protocol.sampling import SamplingParams
from common.reference.prefill import prefill
from common.stages.merge import merge
from common.stages.prompt import build_prompt
from loadtest import machine

DEFAULT_OUT = Path("loadtest/results/bench_grammar.json")
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 64, "maxLength": 400}},
    "required": ["text"],
    "additionalProperties": False,
}
GUIDE = guide_from_request({"guided_json": SCHEMA}, 1 << 16)


def _prefilled(lm: LoadedModel, n: int, sampling: SamplingParams):
    out = []
    for i in range(n):
        text = [{"type": "text", "text": f"Write a long description of scene number {i} as JSON."}]
        prompt = build_prompt(lm, [{"role": "user", "content": text}], [], 8192)
        out.append((f"r{i}", prefill(lm, merge(lm, prompt, []), sampling, 16), sampling))
    return out


def engine_steps(lm: LoadedModel, batch: int, steps: int, guided: bool) -> dict:
    """Median step time of ``steps`` steps with the whole batch running (the first, which admits, not counted)."""
    sampling = SamplingParams(max_tokens=steps + 8, ignore_eos=True, guide=GUIDE if guided else None)
    engine = DecodeEngine(lm, KVPool(4096, 16, lm.kv_shape, lm.dtype), max_batch=batch)
    for request in _prefilled(lm, batch, sampling):
        engine.submit(*request)
    engine.step()
    times = []
    for _ in range(steps):
        assert engine.num_running == batch, "a sequence ended early: the schema must keep every one running"
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    out = {"median_step_ms": 1000 * statistics.median(times)}
    if guided:
        out["mask_ms_per_step"] = 1000 * engine.masks.seconds / engine.masks.steps
    return out


def big_tokenizer(size: int = 151_100):
    """A byte-level BPE tokenizer of ``size`` tokens whose pieces are letter strings (1–4 letters, with and without a
    leading space) built by merges — a real-size vocabulary's trie without training on a corpus that large."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {"<eos>": 0}
    merges: list[tuple[str, str]] = []
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))

    def merge(a: str, b: str) -> None:
        if len(vocab) < size and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))

    letters = string.ascii_lowercase + string.ascii_uppercase
    for a in letters:
        merge("Ġ", a)
    for prefix in ("", "Ġ"):
        for a in letters:
            for b in letters:
                merge(prefix + a, b)
    for prefix in ("", "Ġ"):
        for a in letters:
            for b in letters:
                for c in letters:
                    merge(prefix + a + b, c)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def big_vocab_masks(batch: int, steps: int, seed: int = 0) -> dict:
    """Per step: fill ``batch`` matchers' masks and apply them to random ``[batch, vocab]`` logits; each matcher then
    takes the argmax (so they walk the schema as a model would)."""
    hf = big_tokenizer()
    vocab = len(hf)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(hf, n_vocab=vocab), GUIDE.grammar, log_level=0)
    matchers = [matcher.deep_copy() for _ in range(batch)]
    buffer = MaskBuffer(vocab, batch)
    generator = torch.Generator().manual_seed(seed)
    fill, apply = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator)
        start = time.perf_counter()
        masks = buffer.fill(matchers)
        filled = time.perf_counter()
        apply_masks(logits, list(range(batch)), masks)
        fill.append(filled - start)
        apply.append(time.perf_counter() - filled)
        for m, token in zip(matchers, logits.argmax(-1).tolist(), strict=True):
            assert m.consume_token(token), m.get_error()
    return {
        "vocab": vocab,
        "fill_ms_per_step": 1000 * statistics.median(fill),
        "apply_ms_per_step": 1000 * statistics.median(apply),
        "mask_ms_per_step": 1000 * statistics.median(f + a for f, a in zip(fill, apply, strict=True)),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="prism-small-llava")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--cache-dir", default=ModelConfig().cache_dir)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    lm = load_model(ModelConfig(model=args.model, cache_dir=args.cache_dir, torch_threads=1))
    free = engine_steps(lm, args.batch, args.steps, guided=False)
    guided = engine_steps(lm, args.batch, args.steps, guided=True)
    big = big_vocab_masks(args.batch, args.steps)
    step = free["median_step_ms"]
    result = {
        "benchmark": "grammar",
        "model": args.model,
        "batch": args.batch,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine.facts(),
        "step_ms_free": step,
        "step_ms_all_constrained": guided["median_step_ms"],
        "step_ratio_all_constrained_vs_free": guided["median_step_ms"] / step,
        "mask_ms_per_step": guided["mask_ms_per_step"],
        "mask_fraction_of_step": guided["mask_ms_per_step"] / step,
        "vocab_151k": big,
        "mask_fraction_of_step_at_151k_vocab": big["mask_ms_per_step"] / step,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
