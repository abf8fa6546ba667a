"""Per-request limits on a request's :class:`~common.protocol.vector.ResourceVector`, judged as early as each is known.

:func:`check_limits` refuses a vector over a per-request limit with a 4xx naming it — the ``admission.max_request_*``
limits, the prompt limit (``prompt_too_long``) and the decode KV lease (``kv_lease_exceeded``), so neither of the last
two is first found out after the encoder or prefill ran. The ingress calls it with the vector it knows (complete for a
text-only request, a lower bound with media: over a limit there is over it for certain); the media stage calls it
again once the processor measured the media, before the encoder queue.
"""

from __future__ import annotations

from common.config import AdmissionConfig
from common.errors import InvalidRequestError, MediaTooLarge
from common.protocol.vector import ResourceVector

_LIMITS = (
    # (vector field, config limit, error class, what)
    ("pixels", "max_request_pixels", MediaTooLarge, "source pixels"),
    ("patches", "max_request_patches", MediaTooLarge, "vision patches"),
    ("visual_tokens", "max_request_visual_tokens", InvalidRequestError, "visual tokens"),
    ("max_output_tokens", "max_request_output_tokens", InvalidRequestError, "output tokens (n × max_tokens)"),
)


def check_limits(rv: ResourceVector, cfg: AdmissionConfig, max_prompt_tokens: int, max_lease_blocks: int) -> None:
    """Refuse a vector over any per-request limit: the admission limits, the prompt limit (``prompt_too_long``) and
    the decode stage's per-request KV lease (``kv_lease_exceeded``, what the decode pool would refuse after
    prefill)."""
    for attr, limit_name, err, what in _LIMITS:
        value, limit = getattr(rv, attr), getattr(cfg, limit_name)
        if value > limit:
            raise err(f"request has {value} {what}; the limit is {limit}", code=f"too_many_{attr}")
    if rv.prompt_tokens > max_prompt_tokens:
        expanded = f" ({rv.visual_tokens} of them for {rv.media_items} media items)" if rv.media_items else ""
        raise InvalidRequestError(
            f"prompt is {rv.prompt_tokens} tokens{expanded}; the limit is {max_prompt_tokens}",
            code="prompt_too_long",
            param="messages",
        )
    if rv.kv_blocks > max_lease_blocks:
        outputs = f"{rv.choices} choices × " if rv.choices > 1 else ""
        raise InvalidRequestError(
            f"request needs {rv.kv_blocks} KV blocks (prompt {rv.prompt_tokens} + {outputs}max_tokens "
            f"{rv.max_output_tokens // rv.choices} tokens); the per-request limit is {max_lease_blocks} blocks",
            code="kv_lease_exceeded",
            param="max_tokens",
        )
