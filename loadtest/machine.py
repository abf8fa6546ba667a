"""The machine a benchmark ran on, recorded beside its figures: these machines differ (some AMD EPYC with AVX-512
and native bf16, some without), and a figure read without the CPU it came from cannot be compared or judged.

:func:`facts` gives the platform, Python, the CPUs the machine has and the ones this process may use, the CPU model
and every flag ``/proc/cpuinfo`` lists (what ``lscpu`` shows), those that matter to the engine's kernels picked out,
and torch's version, thread count and build configuration (``torch.__config__.show()``).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

KERNEL_FLAGS = ("fma", "f16c", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16")
"""The flags a CPU decode step's GEMMs and attention can use (AVX2/FMA, AVX-512, native bf16 dot products, AMX)."""


def cpu_info(text: str | None = None) -> tuple[str | None, list[str]]:
    """(model name, flags) of the first processor in ``/proc/cpuinfo`` (``text``: its contents, for tests)."""
    if text is None:
        path = Path("/proc/cpuinfo")
        text = path.read_text() if path.exists() else ""
    model, flags = None, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value.split()
    return model, flags


def facts() -> dict[str, Any]:
    model, flags = cpu_info()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model,
        "kernel_flags": [f for f in KERNEL_FLAGS if f in flags],
        "cpu_flags": flags,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_config": torch.__config__.show(),
    }
