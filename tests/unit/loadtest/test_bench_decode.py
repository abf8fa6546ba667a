"""``loadtest.bench_decode`` on the tiny model: every figure it reports is there, per dtype, and in fp32 the engine's
greedy tokens at batch 32 are ``generate()``'s and the batch-1 path's (bf16's agreement is reported, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.model import linear
from common.model.row_gemm import load_row_gemm
from loadtest import bench_decode, roofline


def test_agreement_counts_identical_answers_and_the_share_before_the_first_difference():
    want = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9]}
    got = {"a": [1, 2, 3, 4], "b": [5, 6, 0, 8], "d": [1]}
    out = bench_decode.agreement(got, want)
    assert out == {"requests": 2, "identical": 0.5, "mean_prefix_fraction": (1.0 + 0.5) / 2}


def test_bench_decode_reports_each_dtype_and_fp32_is_token_exact(model_cache, tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--model", "prism-tiny-llava", "--cache-dir", model_cache, "--tokens", "6", "--repeats", "1"]
    result = bench_decode.main([*argv, "--sequential-requests", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["dtypes"]) == {"float32", "bfloat16"} and result["dtype"] == "float32"
    for figures in result["dtypes"].values():
        assert set(figures["per_batch"]) == {"1", "8", "32"}
        for row in figures["per_batch"].values():
            assert row["median_step_ms"] > 0 and row["bytes_per_step"] > 0 and 0 < row["floor_fraction"]
            assert row["memory_floor_ms"] > 0 and row["compute_floor_ms"] > 0 and row["speedup_vs_sequential"] > 0
            floor = max(row["memory_floor_ms"], row["compute_floor_ms"])
            assert row["bound"] == ("memory" if floor == row["memory_floor_ms"] else "compute")
        assert figures["prefill"]["flops_per_s"] > 0 and figures["b32_weight_gemm_ms"] > 0
        assert figures["read_bytes_per_s"] > 0 and figures["decode_speedup_32_vs_engine_b1"] > 0
        probes = figures["read_bytes_per_s_by_pages"]  # (the floor takes the faster of the two read probes)
        assert set(probes) == {"4KiB", "2MiB"} and figures["read_bytes_per_s"] == max(probes.values())
        assert figures["b32_weight_gemm_ms_onednn"] > 0 and figures["b32_weight_gemm_ms_torch"] > 0  # (each path timed)
    rows = "row kernel + onednn" if load_row_gemm() is not None else "onednn"  # (AVX-512 or AVX2 + FMA)
    assert result["dtypes"]["float32"]["linear_path"] == rows
    assert result["dtypes"]["bfloat16"]["linear_path"] == ("onednn" if linear.usable(torch.bfloat16) else "torch")
    fp32 = result["dtypes"]["float32"]
    assert fp32["attention_paths_b32_step_ms"]["native"] > 0 and fp32["attention_paths_b32_step_ms"]["pytorch"] > 0
    for pair in ("b32_vs_generate", "b32_vs_b1", "b1_vs_generate"):
        assert fp32["agreement_greedy"][pair] == {"requests": 2, "identical": 1.0, "mean_prefix_fraction": 1.0}, pair
    for figures in result["dtypes"].values():  # (the kernel takes both dtypes: its time and the evidence beside it)
        assert figures["attention_paths_b32_step_ms"]["native"] > 0
        assert figures["per_batch"]["32"]["attention_ms_per_step"] > 0
        assert figures["b32_gemm_plus_attention_ms"] > figures["b32_weight_gemm_ms"]
        assert 0 < figures["b32_fraction_if_nothing_else"]


def test_the_huge_page_probe_reads_memory_on_a_2_mib_boundary_and_both_probes_read_it_all():
    region = roofline._region(3 << 20, huge=True)
    assert region.ctypes.data % roofline.HUGE_PAGE == 0 and region.nbytes == 3 << 20 and not region.any()
    probes = roofline.read_probes(8 << 20, repeats=1)
    assert set(probes) == {"4KiB", "2MiB"} and all(rate > 0 for rate in probes.values())


def _huge_kib(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[madvise]" not in THP.read_text(), reason="the probes' pages differ only in THP madvise mode"
)
def test_the_4_kib_probe_reads_memory_nothing_advised_onto_huge_pages():
    """Its memory must not come from numpy, which advises its large arrays onto huge pages (the probe then read 2 MiB
    pages under the 4 KiB name, as eb09328 found); the 2 MiB probe's is advised."""
    # (64 MiB: over glibc's largest mmap threshold, 32 MiB, so a fresh mapping as the probe's 256 MB is; smaller
    # blocks may reuse heap that numpy advised earlier in this process)
    small = roofline._region(64 << 20, huge=False)
    small.fill(1)
    assert _huge_kib(small.ctypes.data + small.nbytes // 2) == 0  # (the middle: advice splits a mapping at 2 MiB)
