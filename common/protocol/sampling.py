"""Sampling parameters of one request, validated at the edge.

``seed`` is resolved once when the request is created (:meth:`SamplingParams.resolved`), and each step's random
draw is seeded from ``(seed, step)``; so a sequence samples the same tokens whether its steps run in one process or
its first token is drawn by prefill in one replica and the rest by decode in another. A request for ``n`` choices
samples choice ``i`` with seed ``seed + i`` (:meth:`SamplingParams.for_choice`): each choice says what the same
request with ``n = 1`` and that seed says.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.errors import InvalidRequestError
from common.grammar.guide import Guide

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64
MAX_CHOICES = 128
"""The engines' bound on ``n`` (the API's is ``server.max_n``, at most this)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a token's log-probabilities may list (OpenAI's bound on ``top_logprobs``)."""
SEED_MODULUS = 2**63


def stop_problem(stops: Sequence[object]) -> str | None:
    """What is wrong with a list of stop strings, or ``None``: the one rule the API (400 ``invalid_stop``) and the
    engines' :class:`SamplingParams` share."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"stop has {len(stops)} strings; the limit is {MAX_STOP_STRINGS}"
    if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH for s in stops):
        return f"each stop string must be 1 to {MAX_STOP_LENGTH} characters"
    return None


def check_choices(n: int, limit: int) -> None:
    """Refuse ``n`` choices over ``limit`` (``server.max_n``): 400 ``too_many_choices`` naming ``n`` — the one rule
    the API and the batch job's rows share."""
    if n > limit:
        raise InvalidRequestError(f"n is {n}; the limit is {limit} choices", code="too_many_choices", param="n")


class SamplingParams(BaseModel):
    """OpenAI-style sampling controls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=64, ge=1)
    """Tokens to generate at most (the first token counts)."""
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    """0 means greedy (argmax), exactly what ``generate(do_sample=False)`` does."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; ignored when greedy."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    """Seed for sampling; ``None`` picks one at random when the request is created."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; it is cut from the returned text."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit once per time it was already generated (OpenAI semantics)."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit if it was generated at all."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it for fixed output lengths)."""
    guide: Guide | None = None
    """The output constraint (structured outputs), checked at the ingress; every sampled token obeys it."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """Return each sampled token's log-probability and this many most likely alternatives (``None``: none) — of the
    model's raw distribution at that position (before the grammar's mask, penalties, temperature and top-p)."""
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices to generate from the one prompt (one prefill; the prompt's KV shared by their sequences)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if isinstance(v, str):
            v = (v,)
        if v is None:
            return ()
        if not isinstance(v, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings")
        problem = stop_problem(v)
        if problem:
            raise ValueError(problem)
        return tuple(v)

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> SamplingParams:
        """A copy with a concrete seed, so every stage that samples for this request agrees."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbits(63)})

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index``'s own sampling: seed ``seed + index`` (modulo 2^63) and ``n = 1`` (needs a resolved
        seed). Choice 0's is this request's seed."""
        if self.seed is None:
            raise ValueError("a choice's sampling needs a resolved seed (SamplingParams.resolved())")
        return self.model_copy(update={"seed": (self.seed + index) % SEED_MODULUS, "n": 1})
