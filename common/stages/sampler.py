"""Token sampling shared by prefill (first token) and decode (the rest).

First the OpenAI frequency / presence penalties, when set: a token already generated ``c`` times loses
``c × frequency_penalty + presence_penalty`` from its logit (the prompt does not count; the first token, drawn by
prefill, has nothing to penalise). Greedy is then ``argmax`` over the logits — exactly ``generate(do_sample=False)``
when no penalty is set. Otherwise temperature scaling, then
nucleus (top-p) filtering, then one multinomial draw from a generator seeded by ``(seed, step)`` — a pure function
of the request and the step index, so it does not matter which process draws which step.

Log-probabilities (``SamplingParams.logprobs``) are read from the raw logits — :func:`log_probs` before any mask,
penalty or temperature — and :func:`token_logprob` picks the sampled token's and the top alternatives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from common.protocol.handoff import FirstToken, TokenLogprob
from common.protocol.sampling import SamplingParams


def _step_generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of logits rows in float32: the raw distribution, before any mask, penalty or temperature."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry in a ``[vocab]`` row of :func:`log_probs`, with the ``top`` most likely tokens (ties: the
    lower id first, as ``torch.topk`` orders them on CPU)."""
    best = torch.topk(row, top) if top else None
    pairs = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return TokenLogprob(float(row[token]), pairs)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, counts: Mapping[int, int]) -> torch.Tensor:
    """A penalised float copy of a ``[vocab]`` row; work grows with the distinct tokens generated, not the vocab."""
    out = logits.float().clone()
    if counts:
        ids = torch.tensor(list(counts.keys()), dtype=torch.long)
        times = torch.tensor(list(counts.values()), dtype=torch.float32)
        out[ids] -= times * params.frequency_penalty + params.presence_penalty
    return out


def plain_greedy(params: SamplingParams, counts: Mapping[int, int] | None) -> bool:
    """Whether :func:`sample_token` takes the row's argmax as it is (greedy, no penalty to apply): a batch may take
    such rows' tokens from one argmax over all its rows."""
    return params.greedy and not (params.penalised and counts)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, step: int, counts: Mapping[int, int] | None = None
) -> int:
    """One token id from a ``[vocab]`` logits row; ``counts`` are the tokens generated so far (for the penalties)."""
    if params.penalised and counts:
        logits = apply_penalties(logits, params, counts)
    if params.greedy:
        return int(torch.argmax(logits))
    if params.seed is None:
        raise ValueError("sampling needs a resolved seed (SamplingParams.resolved())")
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        filtered = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs = filtered / filtered.sum()
    return int(torch.multinomial(probs, 1, generator=_step_generator(params.seed, step)))


def first_tokens(
    logits: torch.Tensor, raw: torch.Tensor | None, params: SamplingParams
) -> tuple[int, TokenLogprob | None, tuple[FirstToken, ...]]:
    """Prefill's first token (step 0) from the last position's (masked) ``logits``, its log-probabilities from the
    ``raw`` row (``None``: not asked), and — for ``n`` > 1 — choices 1 … n-1's first tokens, each drawn with its own
    seed (:meth:`SamplingParams.for_choice`) from the same logits."""

    def draw(p: SamplingParams) -> tuple[int, TokenLogprob | None]:
        token = sample_token(logits, p, step=0)
        return token, None if raw is None else token_logprob(raw, token, params.logprobs or 0)

    first, logprob = draw(params)
    forks = tuple(FirstToken(*draw(params.for_choice(i))) for i in range(1, params.n))
    return first, logprob, forks
