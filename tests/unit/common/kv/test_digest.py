"""The hand-off checksum (:mod:`common.kv.digest`): one value for the same bytes however they are cut into pieces and
however many threads copy or hash them; pinned to its definition (XXH3-64 of the 4 MiB segments' XXH3-64s) and to a
known answer; a copy is shared with the landing threads, writes every byte and raises what a thread raised; a seal
names its checksum (another is a revision mismatch, not corruption); and a KV sealed at export lands, through the
transports, with the checksum of what lies in the pool when the payload spans many segments."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time

import numpy as np
import pytest
import xxhash

from common.errors import HandoffError, RevisionMismatch
from common.kv import digest as D
from common.kv.blocks import check_landed, export_sealed_kv, kv_checksum, seal
from common.kv.transport import make_transport
from common.protocol.sampling import SamplingParams
from loadtest.bench_transfer import payload_cache
from tests.unit.common.kv.kv_decode_worker import fixed_request
from tests.unit.common.kv.test_kv_transports import land

SEG = D.SEGMENT_BYTES


def by_definition(data: np.ndarray) -> int:
    parts = [xxhash.xxh3_64_intdigest(data[i : i + SEG]) for i in range(0, data.size, SEG)] or [
        xxhash.xxh3_64_intdigest(b"")
    ]
    return xxhash.xxh3_64_intdigest(np.array(parts, dtype="<u8").tobytes())


def cut(data: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """``data`` in pieces at random edges, with empty pieces among them (at the start, in the middle, at the end)."""
    edges = sorted({0, data.size, *rng.integers(0, data.size + 1, size=5).tolist()})
    pieces = [data[a:b] for a, b in itertools.pairwise(edges)] or [data]
    empty = data[:0]
    return [empty, *pieces[:1], empty, *pieces[1:], empty]


def test_the_checksum_is_pinned_by_a_known_answer():
    # (a change of segment size, byte order or hash changes every seal: it must come with a new SCHEME)
    assert (D.SEGMENT_BYTES, D.SCHEME) == (4 << 20, "xxh3-64/seg-4MiB")
    data = (np.arange(5 * SEG + 3, dtype=np.int64) % 251).astype(np.uint8)
    assert D.digest([data]) == by_definition(data) == 0xBF8B6F58E9FA35C7


@pytest.mark.parametrize("size", [0, 1, 1000, SEG - 1, SEG, SEG + 1, 3 * SEG + 12345])
def test_the_checksum_is_its_definition_however_the_bytes_are_cut_and_shared(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    want = by_definition(data)
    pieces = cut(data, rng)
    fed = D.SegmentedDigest()
    for p in pieces:
        fed.update(p)
    assert fed.intdigest() == want
    for threads in (1, 2, 3):
        assert D.digest(pieces, threads=threads) == want
        dst = np.zeros_like(data)
        outs = cut(dst, np.random.default_rng(size + threads))  # (destination pieces cut elsewhere than the source)
        pairs, at = [], 0
        for o in outs:
            pairs.append((o, data[at : at + o.size]))
            at += o.size
        assert D.copy_digest(pairs, threads=threads) == want
        np.testing.assert_array_equal(dst, data)


def test_a_changed_byte_changes_the_checksum_in_any_segment():
    data = np.random.default_rng(1).integers(0, 256, 3 * SEG, dtype=np.uint8)
    want = D.digest([data])
    for at in (0, SEG + 7, 3 * SEG - 1):
        bad = data.copy()
        bad[at] ^= 1
        assert D.digest([bad]) != want


def test_a_copy_refuses_unequal_pieces_before_writing_and_raises_what_a_thread_raised():
    src = np.ones(4 * SEG, np.uint8)
    dst = np.zeros(4 * SEG, np.uint8)
    with pytest.raises(ValueError, match="copy of"):
        D.copy_digest([(dst[:SEG], src[:SEG]), (dst[SEG:], src[: SEG - 1])], threads=2)
    assert not dst.any(), "nothing is written before the pieces are checked"
    writable = dst[2 * SEG : 3 * SEG]
    dst.flags.writeable = False  # (views taken from now on are read-only: the second piece's thread raises)
    with pytest.raises(ValueError, match="read-only"):
        D.copy_digest([(writable, src[:SEG]), (dst[3 * SEG :], src[:SEG])], threads=2)


def test_a_copy_is_shared_with_the_landing_threads(monkeypatch):
    src = np.random.default_rng(4).integers(0, 256, 8 * SEG, dtype=np.uint8)
    seen: list[str] = []
    plain = D._do_segment

    def slow(pieces):  # (each segment takes a while, so a helper surely starts before the caller has taken them all)
        seen.append(threading.current_thread().name)
        time.sleep(0.01)
        return plain(pieces)

    monkeypatch.setattr(D, "_do_segment", slow)
    dst = np.zeros_like(src)
    assert D.copy_digest([(dst, src)], threads=2) == by_definition(src)
    np.testing.assert_array_equal(dst, src)
    assert len(seen) == 8 and any(n.startswith("prism-land") for n in seen) and threading.current_thread().name in seen


def test_copies_from_several_callers_at_once_share_the_landing_threads_and_stay_exact():
    rng = np.random.default_rng(2)
    sources = [rng.integers(0, 256, 5 * SEG + i, dtype=np.uint8) for i in range(4)]
    dests = [np.zeros_like(s) for s in sources]
    got: dict[int, int] = {}

    def one(i: int) -> None:
        got[i] = D.copy_digest([(dests[i], sources[i])])

    callers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=60)
    assert got == {i: by_definition(s) for i, s in enumerate(sources)}
    for d, s in zip(dests, sources, strict=True):
        np.testing.assert_array_equal(d, s)


@pytest.mark.parametrize("name", ["object_store", "fake"])
def test_a_kv_of_many_segments_lands_with_its_seal(name, tiny_llava, monkeypatch):
    monkeypatch.setattr(D, "SEGMENT_BYTES", 4096)  # (the tiny model's KV: dozens of segments, several threads)
    monkeypatch.setattr(D, "CHUNK_BYTES", 1024)
    published = seal(fixed_request(tiny_llava, 1, SamplingParams(max_tokens=8, ignore_eos=True)), "req-seg")
    assert published.kv.keys.nbytes > 8 * 4096
    assert published.checksum == kv_checksum(published.kv) == by_definition_at(published.kv, 4096)
    transport = make_transport(name)
    pool, blocks, landed = land(transport, transport.publish(published, expires_at=time.time() + 60), tiny_llava)
    check_landed(published, landed)
    np.testing.assert_array_equal(pool.arrays()[0][:, blocks], published.kv.keys)


def by_definition_at(kv, segment: int) -> int:
    data = np.concatenate([D.flat_bytes(np.ascontiguousarray(kv.keys)), D.flat_bytes(np.ascontiguousarray(kv.values))])
    parts = [xxhash.xxh3_64_intdigest(data[i : i + segment]) for i in range(0, data.size, segment)]
    return xxhash.xxh3_64_intdigest(np.array(parts, dtype="<u8").tobytes())


def test_a_seal_names_its_checksum_and_another_is_a_revision_mismatch(tiny_llava):
    published = seal(fixed_request(tiny_llava, 0, SamplingParams(max_tokens=4)), "req-scheme")
    assert published.checksum_scheme == D.SCHEME
    check_landed(published, kv_checksum(published.kv))
    with pytest.raises(HandoffError, match="corrupted"):
        check_landed(published, kv_checksum(published.kv) ^ 1)
    older = dataclasses.replace(published, checksum_scheme="")  # (sealed by code from before the scheme had a name)
    with pytest.raises(RevisionMismatch, match="checksummed as ''"):
        check_landed(older, kv_checksum(older.kv))
    check_landed(dataclasses.replace(older, checksum=-1), 0)  # (unsealed: in-process paths, nothing claimed)


def test_the_export_seals_what_it_wrote():
    kv, checksum = export_sealed_kv(payload_cache(3 * SEG + SEG // 2), 16)  # (sealed layer by layer as written)
    assert kv.keys.nbytes + kv.values.nbytes > 3 * SEG
    assert checksum == kv_checksum(kv) == by_definition_at(kv, SEG)


def test_a_caller_at_a_lowered_priority_does_its_segments_alone(monkeypatch):
    src = np.random.default_rng(3).integers(0, 256, 4 * SEG, dtype=np.uint8)
    got: dict[str, object] = {}

    def no_pool():
        raise AssertionError("asked for the landing threads")

    def low() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base + 1)  # (this thread only)
        got["full"] = D._at_full_priority()
        got["digest"] = D.copy_digest([(np.zeros_like(src), src)])

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    if base >= 19:
        pytest.skip("this process already runs at the lowest priority")
    monkeypatch.setattr(D, "_landing_pool", no_pool)
    caller = threading.Thread(target=low)
    caller.start()
    caller.join(timeout=60)
    assert got == {"full": False, "digest": by_definition(src)}
    assert D._at_full_priority()  # (this test's own thread)
    with pytest.raises(
        AssertionError, match="landing threads"
    ):  # (and the check is live: a full-priority caller shares)
        D.copy_digest([(np.zeros_like(src), src)])
