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
