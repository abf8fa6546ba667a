"""OpenAI's ``logprobs.content`` entries from the decode stream's :class:`~common.protocol.handoff.TokenLogprob` s:
per generated token its ``token`` (text), ``logprob``, ``bytes`` and ``top_logprobs`` (the same fields each) —
the first token's from prefill, through the hand-off. Values are of the model's raw distribution at each position
(before the grammar's mask, penalties, temperature and top-p)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.errors import HandoffError
from common.model.token_bytes import TokenBytes
from common.protocol.handoff import TokenLogprob


def _field(names: TokenBytes, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": names.text(token_id), "logprob": logprob, "bytes": list(names(token_id))}


def entries(names: TokenBytes, ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> list[dict[str, Any]]:
    """The entries of the tokens ``ids`` (each must have its log-probabilities: a stream that dropped one is a
    hand-off bug, not an answer without them)."""
    out = []
    for token_id, found in zip(ids, logprobs, strict=True):
        if found is None:
            raise HandoffError("the decode stream sent a token without the log-probabilities the request asked for")
        entry = _field(names, token_id, found.logprob)
        entry["top_logprobs"] = [_field(names, i, lp) for i, lp in found.top]
        out.append(entry)
    return out
