"""Stop conditions and the client-visible text, shared by the single-sequence decode stage and the batched engine.

Checked after every token, in this order: EOS (unless ``ignore_eos``), a stop string in the decoded text (the text is
cut before it), ``max_tokens``. EOS and the token that completed a stop string stay in the token ids (as
``generate()`` keeps EOS) but never appear in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.model.loader import LoadedModel
from common.protocol.handoff import FinishReason
from common.protocol.sampling import SamplingParams


def visible_text(tokenizer: Any, token_ids: Sequence[int], sampling: SamplingParams) -> str:
    """The text a client sees: special tokens dropped, cut before the first stop string."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in sampling.stop) if i >= 0), default=len(text))
    return text[:cut]


class StopChecker:
    """Per-sequence stop state; decodes only a short tail of text to look for stop strings."""

    def __init__(self, lm: LoadedModel, sampling: SamplingParams) -> None:
        self._lm = lm
        self._sampling = sampling
        self._eos = frozenset() if sampling.ignore_eos else lm.eos_token_ids
        self._ids: list[int] = []
        # A stop string can span tokens. Visible tokens carry ≥1 character, but byte-level pieces of one UTF-8
        # character may not, so look back twice the longest stop string (plus slack) in tokens.
        self._tail = 2 * max((len(s) for s in sampling.stop), default=0) + 4

    def check(self, token: int, n_generated: int) -> FinishReason | None:
        self._ids.append(token)
        if token in self._eos:
            return "stop"
        if self._sampling.stop:
            tail = self._lm.tokenizer.decode(self._ids[-self._tail :], skip_special_tokens=True)
            if any(s in tail for s in self._sampling.stop):
                return "stop"
        if n_generated >= self._sampling.max_tokens:
            return "length"
        return None
