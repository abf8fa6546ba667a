"""What a benchmark records of its machine: the CPU model and flags from /proc/cpuinfo, torch's build."""

from __future__ import annotations

import sys

import pytest

from loadtest import machine

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu
"""


def test_the_first_processors_model_and_flags_are_read():
    assert machine.cpu_info(CPUINFO) == ("AMD EPYC 9R14", "fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni".split())
    assert machine.cpu_info("") == (None, [])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/cpuinfo")
def test_facts_name_this_cpu_and_torch_build():
    facts = machine.facts()
    assert facts["cpu_model"] and facts["cpu_flags"] and facts["cpus"] >= facts["usable_cpus"] >= 1
    assert set(facts["kernel_flags"]) <= set(facts["cpu_flags"]) and facts["torch_threads"] >= 1
    assert facts["torch"].startswith("2.") and "PyTorch built with" in facts["torch_config"]


def test_caches_are_read_as_the_kernel_lists_them(tmp_path):
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "512K"), (3, "Unified", "16384K")]
    ):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{value}\n")
    assert machine.caches(tmp_path) == {"L1d": 32 << 10, "L2": 512 << 10, "L3": 16 << 20}
    assert machine.caches(tmp_path / "none") == {}


DIAGNOSTICS = """x86.cpu_features.preferred.Avoid_Short_Distance_REP_MOVSB=0x0
x86.cpu_features.data_cache_size=0x8000
x86.cpu_features.shared_cache_size=0x10000000
x86.cpu_features.non_temporal_threshold=0xc000000
x86.cpu_features.rep_movsb_threshold=0x2000
x86.cpu_features.rep_movsb_stop_threshold=0x80000
env_prefix.GLIBC_TUNABLES="x"
"""


def test_glibcs_copy_sizes_are_read_from_its_loaders_diagnostics():
    assert machine.glibc_copy(DIAGNOSTICS) == {
        "data_cache_size": 32 << 10,
        "shared_cache_size": 256 << 20,
        "non_temporal_threshold": 192 << 20,
        "rep_movsb_threshold": 8 << 10,
    }
    assert machine.glibc_copy("") == {} and machine.glibc_copy("x86.cpu_features.shared_cache_size=oops") == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/sys and the dynamic loader")
def test_facts_hold_both_views_of_the_caches():
    facts = machine.facts()
    assert set(facts) >= {"caches", "glibc_copy", "glibc_tunables"}
    assert set(facts["glibc_copy"]) <= set(machine.GLIBC_COPY_KEYS)
    if facts["glibc_copy"]:  # (glibc 2.33 or later on x86: this machine's)
        assert facts["glibc_copy"]["non_temporal_threshold"] > 0
