"""Reference decode: imports a prefill's KV blocks and generates one sequence until a stop condition.

One sequence at a time on a transformers ``DynamicCache`` — the oracle the batched engine (:mod:`common.engine.decode`)
must match token for token; nothing served runs it. Stop conditions live in :mod:`common.stages.stops`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.grammar.compiler import compiler_for
from common.grammar.masks import MaskBuffer, mask_row
from common.kv.blocks import check_prefill, import_kv
from common.model.loader import LoadedModel
from common.protocol.handoff import FinishReason, PrefillOutput, TokenLogprob
from common.protocol.sampling import SamplingParams
from common.stages.sampler import log_probs, sample_token, token_logprob
from common.stages.stops import StopChecker, visible_text


@dataclass(frozen=True)
class DecodeStep:
    """One generated token, and the finish reason if it ended the sequence."""

    token_id: int
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class DecodeResult:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason


def decode_stream(lm: LoadedModel, pre: PrefillOutput, sampling: SamplingParams) -> Iterator[DecodeStep]:
    """Yield tokens one by one, starting with prefill's first token."""
    check_prefill(lm, pre)
    cache = import_kv(pre.kv, lm.text_config, lm.kv_shape, lm.dtype)
    stops = StopChecker(lm, sampling)
    token, logprob = pre.first_token_id, pre.first_logprob
    past = pre.kv.num_tokens
    step = 0
    generated: Counter[int] = Counter()
    matcher = compiler_for(lm).matcher(sampling.guide) if sampling.guide is not None else None
    masks = MaskBuffer(int(lm.text_config.vocab_size))
    with torch.inference_mode():
        while True:
            generated[token] += 1
            reason = stops.check(token, step + 1)
            if matcher is not None:
                if not matcher.consume_token(token) or matcher.is_error():
                    raise RuntimeError(f"the grammar refused token {token} at step {step}")
                if reason in (None, "length") and matcher.is_stopped():
                    reason = "stop"
            yield DecodeStep(token, reason, logprob)
            if reason is not None:
                return
            step += 1
            out = lm.adapter.language_model(lm.model)(
                input_ids=torch.tensor([[token]]),
                position_ids=lm.adapter.decode_positions(torch.tensor([past]), torch.tensor([pre.rope_delta])),
                cache=cache,
                use_cache=True,
            )
            past += 1
            logits = lm.model.lm_head(out.last_hidden_state[:, -1:, :])[0, -1]
            raw = log_probs(logits) if sampling.logprobs is not None else None
            if matcher is not None:
                mask_row(logits, matcher, masks)
            token = sample_token(logits, sampling, step=step, counts=generated)
            logprob = None if raw is None else token_logprob(raw, token, sampling.logprobs or 0)


def decode(lm: LoadedModel, pre: PrefillOutput, sampling: SamplingParams) -> DecodeResult:
    steps = list(decode_stream(lm, pre, sampling))
    ids = tuple(s.token_id for s in steps)
    return DecodeResult(
        token_ids=ids, text=visible_text(lm.tokenizer, ids, sampling), finish_reason=steps[-1].finish_reason
    )
