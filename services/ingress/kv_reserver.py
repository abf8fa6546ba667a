"""The ingress's side of "KV before prefill": reserve a request's decode KV, and give back what no stream claimed.

For each attempt of a request's chain, :class:`services.ingress.chain.Chain` asks :meth:`KVReserver.reserve` for the
blocks its plan estimated (:func:`services.ingress.plan.kv_estimate`) *before* it issues prefill. The decode deployment
(:meth:`services.stages.decode.DecodeDeployment.reserve`) grants them at once, holds the call in its pool's queue, or
refuses (429 / 504 / 400: raised here as they came). The answer names the replica, which goes into the attempt's context
(``decode_replica``, and how it went in ``reservation``) so the decode router sends ``generate`` there; the sequence
claims the lease when its KV arrives. A migration's reservation waits whatever the queue; if the replica has no request
slot left for it, the migration goes on without one (its sequence leases when its KV arrives, as with
``admission.reserve_kv`` off).

Giving back: an attempt that fails or is cancelled before its stream claimed the reservation calls
:meth:`KVReserver.give_back` (fire and forget; the replica drops unclaimed reservations at their deadline anyway). An
answer already on its way when the ingress stopped waiting for it (deadline, caller gone) is awaited in the
background and given back too, so a grant that raced the give-up is not held until the deadline.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from common.config import PrismConfig
from common.errors import DeadlineExceeded, Overloaded
from common.protocol.handoff import KVReservation, RequestContext

log = logging.getLogger("prism.ingress")

LATE_ANSWER_S = 30.0
"""How long past the request's deadline an abandoned reservation call's answer is awaited, so that a grant it carries
can be given back (the replica drops it at the deadline anyway)."""


async def _result(response: Any) -> Any:
    return await response


class KVReserver:
    def __init__(self, cfg: PrismConfig, decode: Any) -> None:
        """``decode``: the model's decode deployment handle."""
        self.cfg, self.decode = cfg, decode

    async def reserve(self, ctx: RequestContext, blocks: int) -> tuple[RequestContext, bool]:
        """Reserve ``blocks`` for the attempt ``ctx`` (a migration's waits whatever the decode queue); returns the
        context naming the replica, and whether a reservation was taken (none when ``admission.reserve_kv`` is off)."""
        if not self.cfg.admission.reserve_kv or blocks <= 0:
            return ctx, False
        response = self.decode.reserve.remote(ctx, blocks)
        try:
            got: KVReservation = await asyncio.wait_for(_result(response), timeout=max(ctx.remaining_s(), 0.001))
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # answered in the instant the caller went away
                raise asyncio.CancelledError
        except Overloaded:
            if ctx.migration:  # a migration the replica has no request slot for: it leases when its KV arrives instead
                return ctx, False
            raise
        except BaseException as exc:
            try:
                response.cancel()
            except Exception:  # (Serve's cancel() re-raises the error of a call that already failed)
                pass
            asyncio.get_running_loop().create_task(self._give_back_late(response, ctx))
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("deadline exceeded waiting for KV blocks in the decode stage") from None
            raise
        outcome = "waited" if got.waited_s > 0 else "reserved"
        return replace(ctx, decode_replica=got.replica, reservation=outcome), True

    async def _give_back_late(self, response: Any, ctx: RequestContext) -> None:
        try:
            got = await asyncio.wait_for(_result(response), timeout=max(ctx.remaining_s(), 0.0) + LATE_ANSWER_S)
        except BaseException:  # cancelled in time, refused, or gone: nothing is held
            return
        self.give_back(replace(ctx, decode_replica=got.replica))

    def give_back(self, ctx: RequestContext) -> None:
        """Drop the attempt's reservation if no stream claimed it (a claimed one is the stream's to free)."""
        try:
            self.decode.unreserve.remote(ctx)
        except Exception:  # (Serve refusing the call must not hide the error that brought the caller here)
            log.warning("could not give back the KV reservation of %s; it lapses at its deadline", ctx.key)
