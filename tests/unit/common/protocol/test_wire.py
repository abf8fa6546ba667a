"""Pickle-free hand-off encoding: exact round trips, and hostile or corrupt bytes are refused."""

from __future__ import annotations

import dataclasses
import io
import pickle

import numpy as np
import pytest

from common.errors import HandoffError
from common.protocol.handoff import (
    FirstToken,
    KVBlocks,
    PlaceholderSpan,
    PrefillOutput,
    TokenizedPrompt,
    TokenLogprob,
)
from common.protocol.wire import from_bytes, to_bytes


def _prefill() -> PrefillOutput:
    kv = KVBlocks(
        block_size=4,
        num_tokens=6,
        dtype="bfloat16",
        keys=np.arange(2 * 2 * 1 * 4 * 3, dtype=np.uint16).reshape(2, 2, 1, 4, 3),
        values=np.ones((2, 2, 1, 4, 3), np.uint16),
    )
    return PrefillOutput(
        prompt_token_ids=np.arange(6, dtype=np.int64), first_token_id=7, kv=kv, rope_delta=-3, model_revision="abc"
    )


def test_round_trip_is_exact():
    pre = _prefill()
    back = from_bytes(PrefillOutput, to_bytes(pre))
    assert back.first_token_id == 7 and back.rope_delta == -3 and back.model_revision == "abc"
    np.testing.assert_array_equal(back.kv.keys, pre.kv.keys)
    assert back.kv.keys.dtype == np.uint16 and back.kv.dtype == "bfloat16"

    # n choices' first tokens and every token's log-probabilities travel with it, typed
    logprob = TokenLogprob(-0.5, ((7, -0.5), (2, -1.25)))
    forks = (FirstToken(2, TokenLogprob(-1.25, ((7, -0.5), (2, -1.25)))), FirstToken(9, None))
    pre = dataclasses.replace(pre, first_logprob=logprob, forks=forks)
    back = from_bytes(PrefillOutput, to_bytes(pre))
    assert back.first_logprob == logprob and back.forks == forks

    span = PlaceholderSpan(0, "image", 3, 4, (4, 8), "d" * 64, (1, 4, 4))
    prompt = TokenizedPrompt(token_ids=np.arange(9), spans=(span, span))
    back = from_bytes(TokenizedPrompt, to_bytes(prompt))
    assert back.spans == (span, span)


def test_pickled_payload_is_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    np.save(buf, np.array([Evil()], dtype=object), allow_pickle=True)
    with pytest.raises(HandoffError):
        from_bytes(PrefillOutput, pickle.dumps(Evil()))
    with pytest.raises(HandoffError):
        from_bytes(PrefillOutput, buf.getvalue())


def test_wrong_class_or_truncated_bytes_are_refused():
    data = to_bytes(_prefill())
    with pytest.raises(HandoffError, match="fields"):
        from_bytes(TokenizedPrompt, data)
    with pytest.raises(HandoffError):
        from_bytes(PrefillOutput, data[: len(data) // 2])


def test_field_types_are_checked():
    pre = _prefill()
    import dataclasses

    bad = dataclasses.replace(pre, first_token_id="7")  # type: ignore[arg-type]
    with pytest.raises(HandoffError, match="expected int"):
        from_bytes(PrefillOutput, to_bytes(bad))
