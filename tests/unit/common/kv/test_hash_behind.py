"""A landing's checksum hashed behind its transfer (common/kv/hash_behind.py): the same checksum as the digest of the
pieces whatever their sizes and however they are published, on the C loop and on the Python fallback; an abort, or a
checksum asked before every piece landed, ends the loop (no thread left waiting); the C loop hashes while another
thread holds the GIL, which is what it is for."""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from common.errors import HandoffError
from common.kv import hash_behind
from common.kv.digest import SEGMENT_BYTES, digest
from common.kv.hash_behind import HashBehind

RNG = np.random.default_rng(7)
SIZES = [1, 0, SEGMENT_BYTES - 3, 5, 2 * SEGMENT_BYTES + 11, 0, 4096, SEGMENT_BYTES]
WHOLE = [SEGMENT_BYTES - 1, 1, 0, SEGMENT_BYTES]
"""A stream of whole segments, one of them cut across two pieces."""


@pytest.fixture(params=[1, 4], ids=["one-thread", "four-threads"])
def executor(request):
    with ThreadPoolExecutor(request.param) as pool:
        yield pool


@pytest.fixture(params=["c-loop", "python"])
def path(request, monkeypatch):
    if request.param == "c-loop":
        assert hash_behind.warm(), "the C loop builds here"
    else:
        monkeypatch.setattr(hash_behind, "_library", lambda: None)
    return request.param


def _pieces(sizes: list[int]) -> list[np.ndarray]:
    return [RNG.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize(
    ("sizes", "steps"),
    [(SIZES, [8]), (SIZES, [1, 2, 3, 4, 5, 6, 7, 8]), (SIZES, [2, 6, 8]), (WHOLE, [4]), (WHOLE, [1, 2, 3, 4])],
)
def test_the_checksum_is_the_pieces_digest_however_they_are_published(path, executor, sizes, steps):
    pieces = _pieces(sizes)
    hashed = HashBehind(pieces, executor)
    for upto in steps:
        hashed.landed(upto)
    assert hashed.intdigest() == digest(pieces)
    assert hashed.intdigest() == digest(pieces), "the same on a second call"


def test_bytes_changed_before_they_land_change_the_checksum(path, executor):
    pieces = _pieces(SIZES[2:5])
    hashed = HashBehind(pieces, executor)
    pieces[1][3] ^= 1
    hashed.landed(3)
    assert hashed.intdigest() == digest(pieces)
    pieces[1][3] ^= 1
    assert hashed.intdigest() != digest(pieces)


def test_an_empty_landing_has_the_empty_streams_checksum(path, executor):
    hashed = HashBehind([np.zeros(0, np.uint8)], executor)
    hashed.landed(1)
    assert hashed.intdigest() == digest([np.zeros(0, np.uint8)])


def test_an_abort_ends_the_loop_without_the_rest(path, executor):
    hashed = HashBehind(_pieces(SIZES), executor)
    hashed.landed(2)
    start = time.monotonic()
    hashed.abort()
    assert time.monotonic() - start < 5
    assert executor.submit(lambda: "free").result(timeout=5) == "free", "the hashing thread is free again"


def test_a_checksum_asked_before_the_last_piece_landed_is_refused_and_ends_the_loop(path, executor):
    hashed = HashBehind(_pieces(SIZES), executor)
    hashed.landed(4)
    with pytest.raises(RuntimeError, match="4 of 8 pieces"):
        hashed.intdigest()
    assert executor.submit(lambda: "free").result(timeout=5) == "free"


def test_a_landing_queued_behind_a_stalled_one_is_hashed_by_its_caller():
    """The executor's one thread holds a landing whose transfer stalls (a slow sender): another landing on the same
    executor still gets its checksum as soon as its own pieces have landed; aborted while still queued, a third
    leaves nothing running."""
    assert hash_behind.warm()
    with ThreadPoolExecutor(1) as executor, ThreadPoolExecutor(1) as caller:
        stalled = HashBehind(_pieces([64]), executor)
        queued = HashBehind(_pieces([64]), executor)
        pieces = _pieces(SIZES[:3])
        hashed = HashBehind(pieces, executor)
        hashed.landed(3)
        assert caller.submit(hashed.intdigest).result(timeout=10) == digest(pieces)
        queued.abort()
        stalled.abort()
        assert executor.submit(lambda: "free").result(timeout=5) == "free"


def test_a_loop_never_given_its_pieces_gives_up_and_its_checksum_is_refused(executor):
    assert hash_behind.warm()
    pieces = _pieces([64, 64])
    hashed = HashBehind(pieces, executor, timeout_s=0.2)
    hashed.landed(1)
    time.sleep(0.6)
    assert executor.submit(lambda: "free").result(timeout=5) == "free", "the thread was given back"
    hashed.landed(2)
    with pytest.raises(HandoffError, match="stopped before its last piece"):
        hashed.intdigest()


def test_the_c_loop_hashes_while_another_thread_holds_the_gil(executor):
    """Each piece published, then the GIL kept for a while by a call through ``ctypes.PyDLL`` — as NIXL's
    ``transfer()`` keeps it while UCX copies the next group: the C loop, inside its one foreign call, has hashed each
    piece by the time the GIL comes back; a hash that went back to Python between segments (the fallback) falls
    behind."""
    assert hash_behind.warm()
    pieces = _pieces([SEGMENT_BYTES] * 8)
    hashed = HashBehind(pieces, executor)
    time.sleep(0.2)  # (the hashing thread is inside the loop, waiting for the first piece)
    hold_the_gil, hashed_by_then = ctypes.PyDLL(None).usleep, []
    for upto in range(1, 9):
        hashed.landed(upto)
        hold_the_gil(30_000)  # (a piece takes well under a ms)
        hashed_by_then.append(int(np.count_nonzero(hashed._digests)))
    assert hashed_by_then == list(range(1, 9))
    assert hashed.intdigest() == digest(pieces)
