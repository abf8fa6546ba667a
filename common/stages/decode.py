"""Decode stage: imports a prefill's KV blocks and generates until a stop condition, streaming tokens.

One sequence at a time on a ``DynamicCache`` (the continuous-batching engine over a paged pool builds on the same
hand-off). Stop conditions, checked after every token in this order: EOS (unless ``ignore_eos``), a stop string in
the decoded text (the text is cut before it), ``max_tokens``. EOS and the token that completed a stop string are
kept in ``token_ids`` (as ``generate()`` keeps EOS) but never appear in ``text``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from common.errors import HandoffError
from common.kv.blocks import import_kv
from common.model.loader import LoadedModel
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from common.stages.sampler import sample_token

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class DecodeStep:
    """One generated token, and the finish reason if it ended the sequence."""

    token_id: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class DecodeResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason


def decode_stream(lm: LoadedModel, pre: PrefillOutput, sampling: SamplingParams) -> Iterator[DecodeStep]:
    """Yield tokens one by one, starting with prefill's first token."""
    if pre.model_revision != lm.contract.model_revision:
        raise HandoffError(f"KV from model revision {pre.model_revision}, this is {lm.contract.model_revision}")
    if pre.kv.num_tokens != len(pre.prompt_token_ids):
        raise HandoffError(f"KV holds {pre.kv.num_tokens} tokens but the prompt has {len(pre.prompt_token_ids)}")
    cache = import_kv(pre.kv, lm.text_config, lm.kv_shape, lm.dtype)
    stops = _StopChecker(lm, sampling)
    token = pre.first_token_id
    past = pre.kv.num_tokens
    step = 0
    with torch.inference_mode():
        while True:
            reason = stops.check(token, step + 1)
            yield DecodeStep(token, reason)
            if reason is not None:
                return
            step += 1
            out = lm.adapter.language_model(lm.model)(
                input_ids=torch.tensor([[token]]),
                position_ids=lm.adapter.decode_positions(past, pre.rope_delta, 1),
                cache=cache,
                use_cache=True,
            )
            past += 1
            logits = lm.model.lm_head(out.last_hidden_state[:, -1:, :])[0, -1]
            token = sample_token(logits, sampling, step=step)


def decode(lm: LoadedModel, pre: PrefillOutput, sampling: SamplingParams) -> DecodeResult:
    steps = list(decode_stream(lm, pre, sampling))
    ids = tuple(s.token_id for s in steps)
    return DecodeResult(token_ids=ids, text=visible_text(lm, ids, sampling), finish_reason=steps[-1].finish_reason)


def visible_text(lm: LoadedModel, token_ids: tuple[int, ...], sampling: SamplingParams) -> str:
    """The text a client sees: special tokens dropped, cut before the first stop string."""
    text = lm.tokenizer.decode(list(token_ids), skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in sampling.stop) if i >= 0), default=len(text))
    return text[:cut]


class _StopChecker:
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
