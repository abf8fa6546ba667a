"""Typed errors that map to HTTP status codes and an OpenAI-style error body.

Every rejection Prism makes is one of these. The ingress turns them into
``{"error": {"message", "type", "code", "param"}}`` with the class's HTTP status; stages raise them instead of
letting a tensor shape error or a KeyError escape. ``code`` is a stable machine-readable string that tests and
clients can match on; ``message`` is for humans and names the limit or the mismatch.
"""

from __future__ import annotations


class PrismError(Exception):
    """Base class: carries an HTTP status, an OpenAI error ``type``, a stable ``code``, the ``param`` at fault and —
    for the errors a client should retry (429, 503) — ``retry_after_s`` (sent as ``Retry-After``)."""

    http_status: int = 500
    error_type: str = "internal_error"
    default_code: str = "internal_error"
    retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def to_body(self) -> dict:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.error_type, "code": self.code, "param": self.param}}


class InvalidRequestError(PrismError):
    """The client sent something malformed or over a limit (HTTP 400)."""

    http_status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class UnsupportedParameter(InvalidRequestError):
    """An OpenAI parameter Prism does not implement, sent with a value other than its default: refused by name rather
    than silently ignored."""

    default_code = "unsupported_parameter"


class RequestTooLarge(PrismError):
    """The request body is over ``server.max_body_bytes`` (HTTP 413), refused while it is read."""

    http_status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class UnsupportedMediaType(PrismError):
    """A request body that is not JSON (``Content-Type``), HTTP 415."""

    http_status = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class SpanMismatchError(InvalidRequestError):
    """Placeholder tokens in the prompt and the visual embeddings disagree (count, order, length or width)."""

    default_code = "placeholder_mismatch"


class UnsupportedModelError(InvalidRequestError):
    """A model directory whose architecture no registered family handles."""

    default_code = "unsupported_model"


class HandoffError(PrismError):
    """A hand-off object between stages failed validation (corrupt, wrong model revision, wrong shape).

    This is an internal fault, not the client's: 500.
    """

    default_code = "invalid_handoff"


class HandoffLost(HandoffError):
    """A hand-off's sender went away before its bytes were read (its replica died mid-transfer, or the hand-off is
    gone): like a lost replica, the ingress issues the request's chain again (before its first token; else 503)."""

    default_code = "handoff_lost"


class RevisionMismatch(HandoffLost):
    """A hand-off from another model revision (weights, encoder) than the replica's own: during a rolling update
    the chain's replicas may be of both revisions, and a request never mixes them — the ingress issues the chain again
    (retried, or migrated), as for a lost hand-off, until its stages are of one revision."""

    default_code = "model_revision_mismatch"


class MediaFetchBlocked(PrismError):
    """Fetch refused by policy: scheme, userinfo, domain list, non-global address, ``file://`` outside the root."""

    http_status = 403
    error_type = "invalid_request_error"
    default_code = "media_fetch_blocked"


class InvalidMediaURL(InvalidRequestError):
    """A media URL that cannot be parsed."""

    default_code = "invalid_media_url"


class TooManyMediaItems(InvalidRequestError):
    default_code = "too_many_media_items"


class MediaTooLarge(PrismError):
    """Bytes, pixels, frames or duration over a configured limit."""

    http_status = 413
    error_type = "invalid_request_error"
    default_code = "media_too_large"


class InvalidMedia(InvalidRequestError):
    """Bytes that are not a supported, intact image or video."""

    default_code = "invalid_media"


class MediaFetchFailed(PrismError):
    """The remote server answered, but not with the media (404, 403, 500 …): the client's URL is at fault."""

    http_status = 422
    error_type = "invalid_request_error"
    default_code = "media_fetch_failed"


class MediaFetchUnavailable(PrismError):
    """Network fault reaching the media host (DNS, connect, reset): retryable."""

    http_status = 502
    error_type = "upstream_error"
    default_code = "media_fetch_unavailable"


class MediaFetchTimeout(MediaFetchUnavailable):
    """The media host did not answer in time: retryable."""

    http_status = 504
    default_code = "media_fetch_timeout"


class Overloaded(PrismError):
    """A stage's in-flight budget is full: retry later (HTTP 429 with Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"
    default_code = "server_overloaded"
    retry_after_s = 1.0


class TenantQuotaExceeded(Overloaded):
    """The tenant is over its own concurrency or rate quota (HTTP 429 with Retry-After); other tenants are not."""

    default_code = "tenant_quota_exceeded"


class DeadlineExceeded(PrismError):
    """The request's deadline budget ran out; the stage refused rather than work for nobody."""

    http_status = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"


class AuthenticationError(PrismError):
    http_status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class ModelNotFound(PrismError):
    http_status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class StageUnavailable(PrismError):
    """A stage replica died or is restarting under this request: retry later (HTTP 503 with Retry-After)."""

    http_status = 503
    error_type = "server_error"
    default_code = "stage_unavailable"
    retry_after_s = 1.0


class RequestTimeout(PrismError):
    """The client sent its request body too slowly (HTTP 408): it was dropped rather than held."""

    http_status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class ProxyBusy(PrismError):
    """A Serve proxy is gathering as many request bodies as it may hold (HTTP 503 with Retry-After)."""

    http_status = 503
    error_type = "server_error"
    default_code = "server_overloaded"
    retry_after_s = 1.0
