"""Deterministic byte-level BPE tokenizer for the embedded tiny/small models.

No tokenizer hub is reachable, so the embedded models get a real ``tokenizers`` BPE tokenizer trained here on
a fixed synthetic corpus. Training is deterministic (fixed corpus, fixed RNG seed, single-threaded merge order
is stable in ``tokenizers``), so the same ``tokenizer.json`` bytes come out on every machine — the model
builder's determinism test relies on that.

The family adapters decide the special tokens (``<image>`` for LLaVA, ``<|image_pad|>`` and friends for
Qwen2-VL); this module only trains and wraps.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# A small, fixed vocabulary of words that VLM prompts and answers use. The corpus is built from these with a
# seeded RNG so merges are learned for common words and the model's random outputs decode to readable-ish text.
_WORDS = (
    "the a an image images photo picture video frame frames clip scene of in on at to from with and or but not "
    "is are was were be been has have had do does did this that these those what which who where when why how "
    "describe explain summarize caption answer question show shows showing see seen look looks like "
    "red orange yellow green blue purple pink brown black white gray grey color colour colors bright dark light "
    "cat cats dog dogs bird car cars bus truck bike tree trees flower house building road street city sky cloud "
    "sun moon water river sea beach mountain field grass snow rain person people man woman child boy girl "
    "small large big tiny huge long short tall wide narrow round square left right top bottom middle center "
    "one two three four five six seven eight nine ten many few some all none first second last next "
    "shape line circle box text number count there here it its they them we you i he she his her our your "
    "yes no maybe very more most less about around near far inside outside behind front above below between"
).split()

_SEED = 1234
_CORPUS_LINES = 4000


def _corpus() -> list[str]:
    rng = random.Random(_SEED)
    lines = []
    for _ in range(_CORPUS_LINES):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize() if rng.random() < 0.5 else words[0]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", "\n"]))
    return lines


def train_bpe_tokenizer(special_tokens: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer; ``special_tokens`` get the lowest ids in the given order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok
