"""A stage replica's heap keeps what a request frees for the next one (``services/platform/memory.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import PrismConfig

ROOT = Path(__file__).resolve().parents[4]

# In a fresh interpreter (glibc's settings are process-wide and a test process has made many allocations): one block
# of 24 MiB allocated, written and freed on the main thread, then the same size again. Where does it lie, does the
# heap keep its pages once it is freed, and does the second allocation get the same memory?
PROBE = """
import ctypes, json, sys
from services.platform.memory import keep_freed_heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
held = keep_freed_heap(int(sys.argv[1]))
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo, hi
    return 0, 0
size = 24 << 20
p = libc.malloc(size)
lo, hi = heap()
ctypes.memset(p, 1, size)
libc.free(p)
lo2, hi2 = heap()
q = libc.malloc(size)
print(json.dumps({"held": held, "in_heap": lo <= p < hi, "kept": hi2 - lo2 >= size, "reused": q == p}))
"""


def probe(keep: int) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(keep)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_kept_heap_serves_and_keeps_a_freed_block() -> None:
    assert probe(256 << 20) == {"held": True, "in_heap": True, "kept": True, "reused": True}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_defaults_map_the_block_apart_and_give_it_back() -> None:
    # (what the setting changes: without it the block is mapped on its own, and unmapped when freed)
    out = probe(0)
    assert out["held"] is False and out["in_heap"] is False and out["reused"] is False


def test_encode_and_prefill_keep_256_mib_by_default_media_and_decode_leave_glibc_alone() -> None:
    stages = PrismConfig.model_validate({"model": {"model": "prism-tiny-llava"}}).deployments
    assert stages.encode.heap_keep_bytes == stages.prefill.heap_keep_bytes == 256 << 20
    assert stages.media.heap_keep_bytes == stages.decode.heap_keep_bytes == 0
