"""The incremental detokenizer streams exactly the text a full decode gives (stop strings cut, special tokens
dropped, multi-byte characters never split), with work per token that does not grow with the output."""

from __future__ import annotations

import random

import pytest

from common.protocol.sampling import SamplingParams
from common.stages.detokenize import Detokenizer
from common.stages.stops import visible_text


def _streamed(tokenizer, ids, stop) -> tuple[str, list[str]]:
    detok = Detokenizer(tokenizer, stop)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.finish())
    return "".join(pieces), pieces


def _random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    vocab = len(tokenizer)
    special = list(tokenizer.all_special_ids)
    return [rng.choice(special) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_equals_full_decode(tiny_model, seed):
    tok = tiny_model.tokenizer
    rng = random.Random(seed)
    ids = _random_ids(tok, rng, rng.randrange(1, 120))
    full = tok.decode(ids, skip_special_tokens=True)
    stop: tuple[str, ...] = ()
    if seed % 2 and len(full) > 8:  # a stop string taken from the middle of the text
        start = rng.randrange(1, len(full) - 4)
        stop = (full[start : start + rng.randrange(1, 4)], "never-appears-here")
    got, _ = _streamed(tok, ids, stop)
    assert got == visible_text(tok, ids, SamplingParams(stop=stop))


def test_multibyte_characters_are_never_split(tiny_llava):
    tok = tiny_llava.tokenizer
    text = "naïve café — 東京の天気は晴れ 🌤️ ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    got, pieces = _streamed(tok, ids, ())
    assert got == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces), "no piece ends inside a character"


def test_tail_that_may_become_a_stop_string_is_held_back(tiny_llava):
    tok = tiny_llava.tokenizer
    ids = tok("hello world, stop here please", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok, ("stop here",))
    sent = ""
    for t in ids:
        sent += detok.push(t)
        assert "stop here" not in sent
        assert len(detok.text) - len(sent) <= len("stop here") - 1 or detok.stopped
    sent += detok.finish()
    assert sent == "hello world, "


def test_decode_work_per_token_is_bounded(tiny_llava):
    """Each push decodes a window of a few tokens, however long the output already is."""
    tok = tiny_llava.tokenizer
    decoded: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(Counting(), ())
    for t in ids:
        detok.push(t)
    assert len(ids) > 300
    assert max(decoded) <= 4, f"a push decoded {max(decoded)} tokens"
