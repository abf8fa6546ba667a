"""A started call in the ingress: its decode stream read under the deadline, decode migration, and closing.

:meth:`services.ingress.pipeline.PipelineClient.begin` returns a :class:`Call` once the decode stream of its chain has
sent its :class:`StreamStart`. From there :class:`CallStream` reads it: :meth:`CallStream.tokens` yields
``(choice index, token_id, finish_reason)`` from the typed decode events until every choice finished (504 at the
deadline, a typed error on an abort or a malformed stream; ``n`` > 1 interleaves the choices' tokens),
:meth:`CallStream.collect` gathers them for a non-streaming response.
:meth:`Call.close` — called once by the request's lifecycle, however it ends — cancels every stage response of the
chain (decode first, so its KV is freed at once) and gives the tenant's quota back.

**Decode migration.** When the decode replica of a started call is lost (the stream raises a replica-lost error),
:meth:`CallStream.tokens` issues the chain again as a new attempt (``Call.reissue``: the prompt's prefill as before,
embeddings from the encoder cache or encoded again) with the tokens the client already received as the decode call's
``replay``: the live replica rebuilds the sequence through them with ordinary decode steps and the stream goes on from
the next token, with no error, no repeat and no gap in what the client receives (:mod:`common.engine.decode`,
*Replay*). At most ``server.max_migrations`` per request, never past its deadline (504); each counted in
``prism_migrations_total{outcome}`` when its outcome is known (``resumed`` at the rebuilt stream's first new token,
``failed``, ``refused``) and listed in the request's trace. A request of ``n`` > 1 choices is not migrated: its lost
replica ends it with the error. A decode replica that *leaves* (scale-down, rolling update, drain) is not lost: its
streams run on there for ``server.drain_grace_s``, then the :class:`~services.ingress.leaving.LeavingWatch` takes each
one still running off it (:meth:`Call.move`) and :meth:`CallStream.tokens` migrates it the same way (cause
``ReplicaLeft``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponseGenerator

from common.errors import DeadlineExceeded, HandoffError, Overloaded, PrismError
from common.model.loader import ModelFrontend
from common.obs.request_trace import RequestTrace
from common.protocol.handoff import RequestContext, StreamAbort, StreamStart, StreamToken, TokenLogprob
from common.protocol.openai import ChatCompletionRequest
from common.protocol.sampling import SamplingParams
from services.ingress.chain import Issue
from services.ingress.failures import CANCELLED, REPLICA_LOST, ReplicaLeft
from services.ingress.leaving import LeavingWatch
from services.ingress.plan import AdmittedRequest
from services.ingress.responses import cancel_chain, next_event
from services.ingress.retry import with_retries

REISSUE_WAIT_S = 1.0
"""The longest a migration waits (jittered exponential backoff from 0.1 s) before asking again a stage that refused its
chain for a full queue."""


@dataclass(kw_only=True)
class Call:
    """A request whose chain answered: its decode stream and everything needed to read, migrate and close it."""

    ctx: RequestContext
    """The context of the attempt whose chain answered."""
    frontend: ModelFrontend
    """The model it runs on (tokenizer for the text, served name)."""
    admitted: AdmittedRequest
    stream: DeploymentResponseGenerator
    prompt_ids: list[int]
    trace: RequestTrace
    chain: list[Any]
    """Every stage response of the attempt (media, encode, prefill, the decode stream): cancelled together."""
    reissue: Issue | None = None
    """Issues the chain again for a decode migration; ``None``: the call cannot be migrated."""
    kv_blocks: int = 0
    """The KV blocks the request held (its choices' together), once every choice finished."""
    migrations: int = 0
    decode_replica: str | None = None
    """The decode replica the stream comes from (as its start said)."""
    leaving: str | None = None
    """Set by :meth:`move`: the replica the stream was taken off because it is leaving; cleared once it moved."""
    watch: LeavingWatch | None = None
    """The watch that moves the stream off a leaving replica, while it is read (:meth:`CallStream.tokens`)."""
    carried: list[StreamToken] = field(default_factory=list)
    """Tokens that came inside the stream's start (:attr:`StreamStart.first`), read before the stream's next item."""
    logprobs: list[list[TokenLogprob | None]] = field(init=False)
    """Per choice, each token's log-probabilities as the stream sent them, in order (``None`` where the request asks
    for none)."""

    def __post_init__(self) -> None:
        self.logprobs = [[] for _ in range(self.admitted.sampling.n)]

    @property
    def rid(self) -> str:
        return self.ctx.request_id

    @property
    def req(self) -> ChatCompletionRequest:
        return self.admitted.request

    @property
    def sampling(self) -> SamplingParams:
        return self.admitted.sampling

    def close(self) -> None:
        """Cancel whatever of the chain still runs; safe to call more than once."""
        cancel_chain(self.chain)
        if self.watch is not None:
            self.watch.forget(self)

    def move(self) -> None:
        """Take the stream off its replica, which is leaving (:mod:`services.ingress.leaving`): the stream is
        cancelled there (its KV freed at once) and :meth:`CallStream.tokens` migrates the call."""
        self.leaving = self.decode_replica
        cancel_chain([self.stream])


@dataclass(frozen=True)
class _Migration:
    started: float
    after_tokens: int
    cause: str


class CallStream:
    """Reads started calls (one per ingress model client); ``count(outcome)`` counts a migration's outcome in
    ``prism_migrations_total`` (the client's, which knows its metrics)."""

    def __init__(
        self,
        max_migrations: int,
        count: Callable[[str], None],
        drain_grace_s: float = 5.0,
        decode_deployment: str | None = None,
        count_left: Callable[[str], None] = lambda deployment: None,
    ) -> None:
        """``drain_grace_s``: how long a stream may go on on a leaving replica of ``decode_deployment`` before it
        moves; ``count_left`` counts a replica that left (:class:`LeavingWatch`)."""
        self.max_migrations = max_migrations
        self._count = count
        self.leaving = LeavingWatch(drain_grace_s, self._movable, decode_deployment, count_left)

    def _movable(self, call: Call) -> bool:
        return (
            call.reissue is not None
            and call.migrations < self.max_migrations
            and call.sampling.n == 1
            and time.time() < call.ctx.deadline
        )

    async def tokens(self, call: Call) -> AsyncIterator[tuple[int, int, str | None]]:
        """``(choice index, token_id, finish_reason)`` until every choice finished; raises 504 / 500 on timeout /
        failure. A lost decode replica is replaced by a migration (up to ``max_migrations``), unseen by the caller."""
        self.leaving.watch(call)  # (until the call closes)
        sent: list[int] = []
        running = call.sampling.n
        moving: _Migration | None = None  # a migration whose stream has not produced a new token yet
        while True:
            try:
                event = call.carried.pop(0) if call.carried else await next_event(call.stream, call.ctx.deadline)
                if isinstance(event, StreamAbort):
                    if event.reason == "timeout":
                        raise DeadlineExceeded("deadline exceeded during decode")
                    raise PrismError("decode failed; see the decode replica's log")
                if not isinstance(event, StreamToken):
                    raise HandoffError(f"the decode stream sent {type(event).__name__} where a token was due")
                if not 0 <= event.index < len(call.logprobs):
                    raise HandoffError(f"the decode stream sent a token of choice {event.index} (n={call.sampling.n})")
            except BaseException as exc:
                left = _left(call, exc)
                if left is None and isinstance(exc, CANCELLED):
                    raise
                if moving is not None:  # the rebuilt stream failed before its first new token
                    self._migration_done(call, moving, "failed")
                    moving = None
                if left is None and not isinstance(exc, REPLICA_LOST):
                    raise
                moving = await self._migrate(call, tuple(sent), left or exc)
                continue
            if moving is not None:
                self._migration_done(call, moving, "resumed")
                moving = None
            else:  # (a migrated stream's spans would repeat stages the trace has; its entry says what it cost)
                call.trace.absorb(event.spans)
            call.trace.token(event.index)
            sent.append(event.token_id)  # (only a single choice is migrated: its tokens in order)
            call.logprobs[event.index].append(event.logprob)
            yield event.index, event.token_id, event.finish_reason
            if event.finish_reason is not None:
                call.kv_blocks += event.kv_blocks
                running -= 1
                if not running:
                    return

    async def collect(self, call: Call) -> list[tuple[list[int], str]]:
        """Every choice's tokens and finish reason, in choice order, for a non-streaming call; the stream is closed
        either way."""
        out: list[list[int]] = [[] for _ in range(call.sampling.n)]
        finish: list[str] = ["stop"] * call.sampling.n
        try:
            async for index, token, reason in self.tokens(call):
                out[index].append(token)
                finish[index] = reason or finish[index]
        finally:
            cancel_chain(call.chain)
        return list(zip(out, finish, strict=True))

    async def _migrate(self, call: Call, sent: tuple[int, ...], lost: BaseException) -> _Migration:
        """Continue ``call`` on a live decode replica after its own was lost: the chain again, replaying ``sent``;
        returns once the new stream started. Re-raises ``lost`` when migration is off or spent (504 when the
        deadline leaves no time)."""
        if time.time() >= call.ctx.deadline:
            self._count("refused")
            raise DeadlineExceeded("deadline exceeded when the decode replica was lost") from lost
        if call.reissue is None or call.migrations >= self.max_migrations or call.sampling.n > 1:
            self._count("refused")
            raise lost
        call.migrations += 1
        cancel_chain(call.chain)  # whatever of the lost attempt still runs (a replica merely unreachable frees its KV)
        moving = _Migration(time.time(), len(sent), type(lost).__name__)
        try:
            # (a stage that refuses the chain for a full queue is asked again until the deadline: the client's stream
            # has started, and a pause is better than an error)
            started = await with_retries(
                lambda: call.reissue(sent),  # type: ignore[misc]
                call.ctx.deadline,
                (Overloaded, BackPressureError),
                max_attempts=None,
                max_delay_s=REISSUE_WAIT_S,
            )
            if list(started.first.prompt_token_ids) != call.prompt_ids:
                cancel_chain(started.responses)
                raise HandoffError("a migrated stream's prompt differs from the original attempt's")
        except CANCELLED:
            raise
        except BaseException:
            self._migration_done(call, moving, "failed")
            raise
        call.chain, call.stream, call.ctx = started.responses, started.stream, started.ctx
        call.decode_replica, call.leaving, call.carried = started.first.replica, None, carried(started.first)
        self.leaving.watch(call)  # (its new replica may be leaving too)
        if started.decode_route is not None:
            call.trace.route("decode", *started.decode_route)
        return moving

    def _migration_done(self, call: Call, moving: _Migration, outcome: str) -> None:
        """Record a migration once its outcome is known: ``resumed`` at the rebuilt stream's first new token (so its
        time covers the chain, the replay and the lease wait), ``failed`` if it ended before that."""
        call.trace.migrated(moving.after_tokens, time.time() - moving.started, moving.cause, outcome)
        self._count(outcome)


def carried(start: StreamStart) -> list[StreamToken]:
    """The tokens a stream's start brought (its first, when decode had it then: :attr:`StreamStart.first`)."""
    return [] if start.first is None else [start.first]


def _left(call: Call, exc: BaseException) -> ReplicaLeft | None:
    """The move behind ``exc``, if that is what it is: the end of a stream the watch took off its leaving replica
    (:meth:`Call.move`; Serve's cancellation error, or whatever else ended it then) — not the caller going away
    (this task cancelled), nor the request's deadline."""
    if call.leaving is None or isinstance(exc, DeadlineExceeded):
        return None
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return None
    return ReplicaLeft(f"decode replica {call.leaving} left its deployment")
