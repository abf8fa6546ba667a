"""The GIL-free XXH3 stream: the ``xxhash`` package's digests, from either path, and hashing beside other threads."""

from __future__ import annotations

import ctypes
import logging
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


LOOPS = {
    "c-loop": (xxh3._LIB, xxh3._copy_hash),  # one call: the chunks looped in C (copy_hash.c)
    "ctypes-loop": (xxh3._LIB, lambda: None),  # no compiler: two foreign calls per chunk
    "package": (None, lambda: None),  # no C functions exported: the package's own hash, under the GIL
}


def test_the_land_loops_in_c_here():
    """A C compiler is on these machines: the land's loop must build (else every landing thread takes the GIL back
    at every chunk)."""
    assert xxh3._copy_hash() is not None


@pytest.mark.parametrize("chunk", [1, 4096, 1000003, 1 << 20, 8 << 20])
@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_a_copy_update_copies_every_byte_and_hashes_what_it_wrote(chunk, loop, monkeypatch):
    src = DATA[:4099] if chunk == 1 else DATA  # (byte chunks: a small piece keeps the loop short)
    lib, native = LOOPS[loop]
    monkeypatch.setattr(xxh3, "_LIB", lib)
    monkeypatch.setattr(xxh3, "_copy_hash", native)
    for piece in (src, src[:0], src[:7]):  # (empty, and shorter than any chunk)
        dst = np.zeros_like(piece)
        s = xxh3.Stream()
        s.update(DATA[:9])  # (a stream already fed goes on from where it was)
        s.copy_update(dst, piece, chunk)
        np.testing.assert_array_equal(dst, piece)
        assert s.intdigest() == xxhash.xxh3_64_intdigest(DATA[:9].tobytes() + piece.tobytes())


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_a_copy_update_refuses_before_it_writes(loop, monkeypatch):
    lib, native = LOOPS[loop]
    monkeypatch.setattr(xxh3, "_LIB", lib)
    monkeypatch.setattr(xxh3, "_copy_hash", native)
    dst = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="copy of"):
        xxh3.Stream().copy_update(dst, DATA[:4095], 1024)
    for bad_dst, bad_src in (
        (dst.view(np.uint16), DATA[:4096].view(np.uint16)),  # not bytes
        (dst, DATA[:4096][::-1]),  # a reversed source: its address is its last byte
        (dst, DATA[: 2 * 4096 : 2]),  # a strided source
        (dst.reshape(64, 64), DATA[:4096].reshape(64, 64)),  # not flat
    ):
        with pytest.raises(ValueError, match="flat"):
            xxh3.Stream().copy_update(bad_dst, bad_src, 1024)
    with pytest.raises(ValueError, match="chunks"):
        xxh3.Stream().copy_update(dst, DATA[:4096], 0)
    frozen = np.zeros(4096, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        xxh3.Stream().copy_update(frozen, DATA[:4096], 1024)
    assert not dst.any() and not frozen.any()


def test_without_a_compiler_the_land_loops_in_python(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRISM_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # (a compiler that fails: no library can be built)
    with caplog.at_level(logging.WARNING, logger="prism.kv.xxh3"):
        assert xxh3._copy_hash.__wrapped__() is None
    assert "loops in Python" in caplog.text
    monkeypatch.setattr(xxh3, "_copy_hash", xxh3._copy_hash.__wrapped__)  # (every call without the C loop)
    dst = np.zeros(1 << 20, np.uint8)
    s = xxh3.Stream()
    s.copy_update(dst, DATA[: 1 << 20], 4096)
    assert s.intdigest() == xxhash.xxh3_64_intdigest(DATA[: 1 << 20]) and (dst == DATA[: 1 << 20]).all()


def test_a_failed_update_in_the_c_loop_raises_and_stops():
    """The C loop stops at the update's first nonzero status (XXH3's own fails only on a null input; an update that
    fails is given here in its place) and the call says so: nothing after that chunk is copied."""
    loop = xxh3._copy_hash().args[0]
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(lambda *_: 1)
    dst = np.zeros(32, np.uint8)
    with pytest.raises(RuntimeError, match="update failed"):
        xxh3._call_loop(loop, ctypes.cast(failing, ctypes.c_void_p).value, 0, dst, DATA[:32], 8)
    assert (dst[:8] == DATA[:8]).all() and not dst[8:].any()
