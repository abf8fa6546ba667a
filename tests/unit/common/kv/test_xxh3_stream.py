"""The GIL-free XXH3 stream: the ``xxhash`` package's digests, from either path, and hashing beside other threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from common.kv import xxh3

DATA = np.random.default_rng(7).integers(0, 256, size=(3 << 20) + 123, dtype=np.uint8)


@pytest.mark.parametrize("cuts", [[], [0], [1], [240, 241], [1000, 1 << 20, (2 << 20) + 5]])
def test_the_stream_gives_the_packages_digest_however_the_bytes_are_cut(cuts, monkeypatch):
    want = xxhash.xxh3_64_intdigest(DATA)
    for lib in (xxh3._LIB, None):  # the C functions without the GIL, and the package's own fallback
        monkeypatch.setattr(xxh3, "_LIB", lib)
        s = xxh3.Stream()
        at = 0
        for cut in [*cuts, DATA.size]:
            s.update(DATA[at:cut])
            at = cut
        assert s.intdigest() == want
        s.reset()
        s.update(DATA[:5])
        assert s.intdigest() == xxhash.xxh3_64_intdigest(DATA[:5])


def test_the_package_exports_the_functions_here():
    """``xxhash`` is pinned: this build exports the C functions (else every hand-off hashes under the GIL)."""
    assert xxh3.GIL_FREE


def test_streams_on_several_threads_agree_with_the_package():
    want = xxhash.xxh3_64_intdigest(DATA[: 1 << 20])
    got: list[int] = []

    def work() -> None:
        for _ in range(20):
            s = xxh3.Stream()
            for at in range(0, 1 << 20, 64 << 10):
                s.update(DATA[at : at + (64 << 10)])
            got.append(s.intdigest())

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 60


@pytest.mark.skipif(not xxh3.GIL_FREE, reason="the package's own path takes any buffer")
def test_only_flat_bytes_are_hashed():
    with pytest.raises(ValueError):
        xxh3.Stream().update(DATA[:16].view(np.uint16))
