"""The grammar benchmark's parts: its 151k-token vocabulary is a working byte-level BPE, and a short run on the tiny
model reports every number it promises (timings are the bench's business, not a test's)."""

from __future__ import annotations

import json

from loadtest import bench_grammar


def test_the_real_size_vocabulary_tokenizes_and_decodes():
    hf = bench_grammar.big_tokenizer()
    assert len(hf) == 151_100
    ids = hf.encode("Hello world abc", add_special_tokens=False)
    assert hf.decode(ids) == "Hello world abc" and len(ids) < len("Hello world abc")  # merged pieces


def test_a_short_run_reports_each_figure(model_cache, tmp_path):
    out = tmp_path / "grammar.json"
    result = bench_grammar.main(
        ["--model", "prism-tiny-llava", "--cache-dir", model_cache, "--steps", "3", "--batch", "4", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert result["vocab_151k"]["vocab"] == 151_100
    for key in ("step_ms_free", "step_ms_all_constrained", "mask_ms_per_step", "mask_fraction_of_step_at_151k_vocab"):
        assert result[key] > 0
