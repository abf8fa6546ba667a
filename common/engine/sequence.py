"""What the decode engine holds for each running sequence, and what it hands its caller.

A :class:`RunningSequence` exists from the moment its sequence starts (its prompt's KV in the pool and prefill's first
token known) to the moment it finishes, is cancelled or aborted (:class:`common.engine.decode.DecodeEngine`); every
step reads its block table, length and last token, and the tokens it samples or replays move its step, stop state,
penalty counts and grammar on. A request of ``n`` > 1 choices has one per choice, keyed ``(request id, index)``, all
under the request's one lease. :class:`TokenEvent` is what the engine reports: each token it emits, and the end of a
sequence that ended with no token (a deadline, a failed step).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

import llguidance

from common.kv.pool import Lease
from common.protocol.handoff import FinishReason, TokenLogprob
from common.protocol.sampling import SamplingParams
from common.stages.stops import StopChecker

EngineFinish = FinishReason | Literal["timeout", "error"]


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None
    """``None`` only on a ``timeout`` / ``error`` event, which carries no token."""
    finish_reason: EngineFinish | None
    """``None`` while the sequence goes on. Cancel emits nothing: it is the caller's own act."""
    logprob: TokenLogprob | None = None
    """The token's log-probabilities, when its request asks for them."""
    index: int = 0
    """The request's choice the token belongs to (``n`` > 1)."""


@dataclass
class RunningSequence:
    request_id: str
    sampling: SamplingParams
    """The choice's own (:meth:`SamplingParams.for_choice`)."""
    lease: Lease
    """The request's (shared by its choices)."""
    table: list[int]
    """The sequence's blocks in order (shared prompt blocks, then its own)."""
    rope_delta: int
    length: int
    """Tokens whose KV is in the pool."""
    last_token: int
    """Sampled but not yet fed to the model."""
    step: int
    stops: StopChecker
    deadline: float | None
    counts: Counter[int] = field(default_factory=Counter)
    """Tokens generated so far (kept only when the request sets a frequency/presence penalty)."""
    matcher: llguidance.LLMatcher | None = None
    """The output grammar's state (``None``: unconstrained), advanced by every emitted or replayed token."""
    forced: deque[int] = field(default_factory=deque)
    """Replayed tokens still to feed (the client already has them): taken instead of sampled, never emitted."""
    diverged: bool = False
    index: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index
