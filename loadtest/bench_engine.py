"""``make bench``'s in-process figures: the decode engine (:mod:`loadtest.bench_decode`) and the KV hand-offs
(:mod:`loadtest.bench_transfer`, :mod:`loadtest.bench_ucx`), each turned into its figures' records.

* ``decode_speedup_32_vs_sequential`` (over the reference decode, one request at a time),
  ``decode_speedup_32_vs_engine_b1`` (over Prism's engine at batch 1), ``decode_roofline_fraction_b32`` (against
  max(memory floor, compute floor)) — fp32; beside them, per dtype (fp32 and bf16) step time, bytes per step, floors,
  roofline fraction and speedup at batch 1/8/32, the native vs PyTorch attention step,
  greedy agreement, and prefill against its FLOPs.
* ``handoff_bw_fraction_of_memcpy`` — a KV payload through the object store between two processes, from publish to
  the decode pool's blocks with the seal checked, / one warm memcpy; the lower of 64 MB and 256 MB (two copies: 0.5
  at one memcpy's rate; the land is shared between the cores).
* ``nixl_bw_fraction_of_memcpy`` — the same over NIXL (UCX, DRAM to DRAM); beside it, what one READ between
  pre-registered buffers reaches with each UCX transport; ``nixl_vs_ucx_read`` — the one over the other.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from loadtest import bench_ucx
from loadtest.figures import bandwidth, record


def decode_figures(model: str, runs: int, tokens: int, out: Path) -> dict[str, Any]:
    """The decode figures from ``runs`` runs of :mod:`loadtest.bench_decode` (its own JSON written to ``out``)."""
    from loadtest import bench_decode

    dec = bench_decode.main(["--model", model, "--out", str(out), "--repeats", str(runs), "--tokens", str(tokens)])
    median_run = {
        "timed": "end to end on both sides: from the prefill output handed over (KV import included)",
        "engine_b32_e2e_tokens_per_s": dec["engine"]["32"]["e2e_tokens_per_s"],
        "sequential_e2e_tokens_per_s": dec["sequential"]["e2e_tokens_per_s"],
        "speedup_after_kv_import": dec["decode_speedup_32_vs_sequential_steps"],
        "engine_b32_tokens_per_s": dec["engine"]["32"]["tokens_per_s"],
        "sequential_tokens_per_s": dec["sequential"]["tokens_per_s"],
        "of_the_run": "the median one",
    }
    roofline = {
        "floor": "per step max(bytes / read bandwidth of the engine's threads (the faster read probe: 4 KiB or "
        "2 MiB pages), FLOPs / the GEMM peak on 512 rows)",
        "runs": [
            {"achieved_bytes_per_s": achieved, "read_bytes_per_s": dec["read_bytes_per_s"]}
            for achieved in dec["engine_b32_bytes_per_s_runs"]
        ],
        "read_bytes_per_s": dec["read_bytes_per_s"],
        "read_bytes_per_s_by_pages": dec["read_bytes_per_s_by_pages"],
        "memcpy_bytes_per_s": dec["memcpy_bytes_per_s"],
        "gemm_flops_per_s": dec["gemm_flops_per_s"],
        "torch_threads": dec["torch_threads"],
        "b32": dec["per_batch"]["32"],
        "b32_weight_gemm_ms": dec["b32_weight_gemm_ms"],
        "b32_weight_gemm_flops_per_s": dec["b32_weight_gemm_flops_per_s"],
        "b32_weight_gemm_ms_onednn": dec["b32_weight_gemm_ms_onednn"],
        "b32_weight_gemm_ms_torch": dec["b32_weight_gemm_ms_torch"],
        "linear_path": dec["linear_path"],
        "b32_attention_ms_per_step": dec["per_batch"]["32"]["attention_ms_per_step"],
        "b32_attention_kv_bytes_per_s": dec["per_batch"]["32"]["attention_kv_bytes_per_s"],
        "b32_gemm_plus_attention_ms": dec["b32_gemm_plus_attention_ms"],
        "b32_fraction_if_nothing_else": dec["b32_fraction_if_nothing_else"],
        "b32_serial_floor_ms": dec["b32_serial_floor_ms"],
        "serial_ceiling": dec["decode_roofline_fraction_b32_serial_ceiling"],
        "b32_layer_kernels_ms_per_step": dec["b32_layer_kernels_ms_per_step"],
        "b32_outside_layer_kernels_ms_per_step": dec["b32_outside_layer_kernels_ms_per_step"],
    }
    kept = ("per_batch", "attention_paths_b32_step_ms", "agreement_greedy", "prefill", "b32_weight_gemm_ms")
    kept += ("b32_weight_gemm_flops_per_s", "read_bytes_per_s", "gemm_flops_per_s", "decode_speedup_32_vs_engine_b1")
    kept += ("read_bytes_per_s_by_pages",)
    kept += (
        "b32_weight_gemm_ms_onednn",
        "b32_weight_gemm_ms_torch",
        "linear_path",
        "b32_gemm_plus_attention_ms",
        "b32_fraction_if_nothing_else",
        "b32_serial_floor_ms",
        "decode_roofline_fraction_b32_serial_ceiling",
        "decode_speedup_32_vs_b1_at_floors",
        "b32_layer_kernels_ms_per_step",
        "b32_outside_layer_kernels_ms_per_step",
    )
    per_dtype = {dtype: {k: f[k] for k in kept} for dtype, f in dec["dtypes"].items()}
    median_run["per_dtype"] = per_dtype  # step time, floors, roofline fraction and speedup at 1/8/32; prefill vs FLOPs
    speedups, fractions = dec["decode_speedup_32_vs_sequential_runs"], dec["decode_roofline_fraction_b32_runs"]
    vs_b1 = dec["decode_speedup_32_vs_engine_b1_runs"]
    return {
        "decode_speedup_32_vs_sequential": record("decode_speedup_32_vs_sequential", speedups, median_run),
        "decode_speedup_32_vs_engine_b1": record(
            "decode_speedup_32_vs_engine_b1",
            vs_b1,
            {
                "b1": "the engine at batch 1, the requests one after another",
                "at_floors": dec["decode_speedup_32_vs_b1_at_floors"],
                "at_floors_is": "32 x the b1 step's floor / the b32 step's floor: the steps alone at their floors",
            },
        ),
        "decode_roofline_fraction_b32": record("decode_roofline_fraction_b32", fractions, roofline),
    }


def grammar_figures(model: str, runs: int, steps: int, out: Path) -> dict[str, Any]:
    """``grammar_mask_fraction_of_b32_step``: the masks of 32 JSON-constrained sequences at a 151k-token vocabulary,
    per step, over the model's b32 step with no grammar (:mod:`loadtest.bench_grammar`, ``runs`` runs; each run's
    JSON beside ``out``); beside it, on the model itself, its constrained step against its free one."""
    from loadtest import bench_grammar

    results = [
        bench_grammar.main(["--model", model, "--steps", str(steps), "--out", str(out.with_suffix(f".{i}.json"))])
        for i in range(runs)
    ]
    kept = ("step_ms_free", "step_ms_all_constrained", "step_ratio_all_constrained_vs_free", "mask_ms_per_step",
            "mask_fraction_of_step", "vocab_151k")  # fmt: skip
    raw = [{k: r[k] for k in kept} for r in results]
    values = [r["mask_fraction_of_step_at_151k_vocab"] for r in results]
    return {"grammar_mask_fraction_of_b32_step": record("grammar_mask_fraction_of_b32_step", values, raw)}


STORE_BYTES = 1 << 30
"""The hand-off session's object store."""


def nixl_versus_ucx(nx: dict[str, Any], size: int) -> tuple[float | None, list[float | None]]:
    """UCX's default READ (of ``size`` bytes) as a fraction of memcpy, and each NIXL hand-off of ``size`` over the
    READ timed beside it (repeat by repeat: :func:`loadtest.bench_transfer.measure`'s ``beside``).

    UCX's READ is of the largest size only, so NIXL's hand-offs of that size are what it is compared with — both
    fractions of the one memcpy measured at that size. Until 2026-12-04 NIXL's headline (the worse of its two sizes)
    was compared here; until 2026-12-06 with the median of READs timed after every hand-off rather than between
    them (on this shared machine, a slow spell then fell on one side only: the same code read 0.48–0.84)."""
    ucx = nx["ucx_read"].get("default", {})
    fractions = nx["sizes"][str(size)]["fractions"]
    if "fractions" not in ucx:
        return None, [None for _ in fractions]
    return ucx["fraction_of_memcpy"], [f / u for f, u in zip(fractions, ucx["fractions"], strict=True)]


def nixl_beside_ucx(runs: int, ucx_transports: dict[str, str | None]) -> dict[str, Any]:
    """NIXL's hand-off figures with UCX's default READ of the largest size timed between its hand-offs of that size
    (``ucx_read["default"]``), and UCX's READ with each other transport of ``ucx_transports`` on its own."""
    from loadtest import bench_transfer

    size, errors = bench_transfer.SIZES[-1], []
    try:
        read_once, end = bench_ucx.beside(size)
    except Exception as exc:  # (UCX would not start here: the hand-offs are still measured, the ratio is not)
        read_once, end = None, lambda: None
        errors.append(bench_ucx.failure(exc))

    def guarded() -> float:
        """One READ's seconds; after a READ that failed, none is timed (NaN) and the error is kept, not raised: the
        hand-offs and the figures after them are still measured."""
        if errors:
            return math.nan
        try:
            return read_once()  # type: ignore[misc]
        except Exception as exc:
            errors.append(bench_ucx.failure(exc))
            return math.nan

    try:
        nx = bench_transfer.transport_figures("nixl", runs, beside={size: guarded} if read_once else None)
    finally:
        end()
    at_size = nx["sizes"][str(size)]
    memcpy, side = at_size["memcpy_bytes_per_s"], at_size.pop("beside_seconds", None)
    timed = side and not errors
    default = {"ucx_tls": "unset", "timed": "between the hand-offs", **bandwidth(size, side, memcpy)} if timed else None
    error = errors[0] if errors else "no READ timed"
    others = {label: tls for label, tls in ucx_transports.items() if tls is not None}
    nx["ucx_read"] = {"default": default or {"ucx_tls": "unset", "error": error}}
    nx["ucx_read"] |= bench_ucx.figures(size, memcpy, runs, others)
    return nx


def transfer_figures(store_runs: int, nixl_runs: int, ucx_transports: dict[str, str | None]) -> dict[str, Any]:
    """The hand-off figures, in a Ray session of their own (the NIXL agents' UCX threads must not linger beside the
    servers measured later)."""
    import ray

    from loadtest import bench_transfer

    # The store pre-faulted at start (Ray's RAY_preallocate_plasma_memory, with an explicit size): a put never pays
    # for fresh pages; each process still maps the pages on first touch (the warm-ups cycle through the store).
    os.environ["RAY_preallocate_plasma_memory"] = "1"
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=STORE_BYTES,
    )
    try:
        store = bench_transfer.transport_figures("object_store", store_runs, STORE_BYTES)
        nx = nixl_beside_ucx(nixl_runs, ucx_transports)
    finally:
        ray.shutdown()
    note = (
        "publish (ray.put) + open + land in the decode pool's leased blocks + the seal's check on what landed; "
        "two copies: 0.5 at one memcpy's rate (copy_floor; the land is shared between the cores and may pass it); "
        "steady state after the warm-ups (cold_seconds: the first)"
    )
    nixl_note = (
        "publish + open + one READ from the sender's staging arena into the decode pool's leased blocks + the seal's "
        "check (hashed as the groups land); one copy; ucx_read: one READ between pre-registered buffers, UCX's own "
        "ceiling (loadtest/bench_ucx.py); nixl_vs_ucx_read: each hand-off of ucx_read's size over the default "
        "READ timed beside it"
    )
    ucx, versus = nixl_versus_ucx(nx, bench_transfer.SIZES[-1])
    return {
        "handoff_bw_fraction_of_memcpy": record("handoff_bw_fraction_of_memcpy", store["fractions"], store, note=note),
        "nixl_bw_fraction_of_memcpy": record("nixl_bw_fraction_of_memcpy", nx["fractions"], nx, note=nixl_note),
        "nixl_vs_ucx_read": record(
            "nixl_vs_ucx_read",
            versus,
            {"ucx_read_fraction_of_memcpy": ucx},
            note="each NIXL hand-off of the largest size: its fraction of memcpy over that of UCX's own READ of that "
            "size (UCX_TLS unset) timed beside it, after or before it alternately",
        ),
    }
