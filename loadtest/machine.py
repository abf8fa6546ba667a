"""The machine a benchmark ran on, recorded beside its figures: these machines differ (some AMD EPYC with AVX-512
and native bf16, some without), and a figure read without the CPU it came from cannot be compared or judged.

:func:`facts` gives the platform, Python, the CPUs the machine has and the ones this process may use, the CPU model
and every flag ``/proc/cpuinfo`` lists (what ``lscpu`` shows), those that matter to the engine's kernels picked out,
torch's version, thread count and build configuration (``torch.__config__.show()``), and the caches twice over: as
the kernel reports them (:func:`caches`) and as glibc sized them for its copies (:func:`glibc_copy`).

Why both caches. The copy figures are fractions of one memcpy, and glibc's memcpy changes method with size: past
its non-temporal threshold (three quarters of the shared cache it detected) it writes around the caches, without
reading each destination line first — one pass of memory traffic less. glibc takes the cache sizes from the CPU's
own report, which a virtual machine may get wrong: one of these hosts (2-core AMD EPYC Zen 2) tells glibc of a
256 MiB shared cache where the kernel lists a 16 MiB L3, so its threshold is 192 MiB and a 64 MB memcpy runs at
8.9 GB/s where a 256 MB one runs at 16.2 (``docs/benchmarks.md``, the hand-off).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
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


CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
GLIBC_COPY_KEYS = ("data_cache_size", "shared_cache_size", "non_temporal_threshold", "rep_movsb_threshold")
"""What glibc's ``ld.so --list-diagnostics`` says of the sizes its x86 memcpy is tuned by (``x86.cpu_features.*``)."""


def caches(root: Path = CACHES) -> dict[str, int]:
    """Bytes of CPU 0's data and unified caches as the kernel lists them (``L1d``, ``L2``, ``L3``); empty where it
    lists none."""
    out = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind == "Instruction":
            continue
        found = re.fullmatch(r"(\d+)([KMG]?)", size)
        if found:
            scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[found.group(2)]
            out[f"L{level}{'d' if kind == 'Data' else ''}"] = int(found.group(1)) * scale
    return out


def glibc_copy(text: str | None = None) -> dict[str, int]:
    """glibc's own cache sizes and copy thresholds in bytes (:data:`GLIBC_COPY_KEYS`), from its dynamic loader's
    diagnostics (glibc 2.33 on; ``text``: their output, for tests); empty where there are none (another libc, an
    older glibc, no x86). ``GLIBC_TUNABLES`` in the environment changes them, and is what the process ran with."""
    if text is None:
        text = _loader_diagnostics()
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        prefix, _, name = key.strip().rpartition(".")
        if prefix == "x86.cpu_features" and name in GLIBC_COPY_KEYS:
            try:
                out[name] = int(value.strip(), 0)
            except ValueError:
                continue
    return out


@functools.cache  # (glibc reads its tunables once, at the process's start: the answer cannot change after)
def _loader_diagnostics() -> str:
    loader = next((line.split()[-1] for line in _maps() if "/ld-linux" in line), None)
    if loader is None:
        return ""
    try:
        done = subprocess.run([loader, "--list-diagnostics"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _maps() -> list[str]:
    try:
        return Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []


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
        "caches": caches(),
        "glibc_copy": glibc_copy(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }
