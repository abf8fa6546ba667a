"""Every rejection maps to a distinct code, the documented HTTP status and an OpenAI-style body."""

from __future__ import annotations

import pytest
from PIL import Image

from common import errors
from common.config.media import MediaConfig
from common.media.stage import MediaStage

EXPECTED = {
    errors.InvalidRequestError: (400, "invalid_request"),
    errors.SpanMismatchError: (400, "placeholder_mismatch"),
    errors.UnsupportedModelError: (400, "unsupported_model"),
    errors.TooManyMediaItems: (400, "too_many_media_items"),
    errors.InvalidMedia: (400, "invalid_media"),
    errors.InvalidMediaURL: (400, "invalid_media_url"),
    errors.MediaFetchBlocked: (403, "media_fetch_blocked"),
    errors.MediaTooLarge: (413, "media_too_large"),
    errors.MediaFetchFailed: (422, "media_fetch_failed"),
    errors.MediaFetchUnavailable: (502, "media_fetch_unavailable"),
    errors.MediaFetchTimeout: (504, "media_fetch_timeout"),
    errors.HandoffError: (500, "invalid_handoff"),
    errors.AuthenticationError: (401, "invalid_api_key"),
    errors.UnsupportedParameter: (400, "unsupported_parameter"),
    errors.RequestTooLarge: (413, "request_too_large"),
    errors.UnsupportedMediaType: (415, "unsupported_media_type"),
    errors.ModelNotFound: (404, "model_not_found"),
    errors.Overloaded: (429, "server_overloaded"),
    errors.StageUnavailable: (503, "stage_unavailable"),
    errors.DeadlineExceeded: (504, "deadline_exceeded"),
}


@pytest.mark.parametrize("cls", list(EXPECTED))
def test_status_code_and_body(cls):
    err = cls("the limit is 3", param="messages")
    assert (err.http_status, err.code) == EXPECTED[cls]
    body = err.to_body()
    assert set(body) == {"error"}
    assert body["error"] == {"message": "the limit is 3", "type": err.error_type, "code": err.code, "param": "messages"}


def test_only_retryable_errors_carry_retry_after():
    assert not issubclass(errors.StageUnavailable, errors.Overloaded), "a 503 is not a kind of 429"
    assert errors.Overloaded("full").retry_after_s == 1.0
    assert errors.StageUnavailable("gone", retry_after_s=3).retry_after_s == 3
    assert errors.Overloaded("full", retry_after_s=2.5).retry_after_s == 2.5
    assert errors.InvalidRequestError("bad").retry_after_s is None
    assert errors.DeadlineExceeded("late").retry_after_s is None


def test_codes_are_distinct():
    codes = [code for _, code in EXPECTED.values()]
    assert len(codes) == len(set(codes))


def test_media_stage_refuses_to_start_with_pillow_guard_disabled(monkeypatch):
    MediaStage(MediaConfig())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(RuntimeError):
        MediaStage(MediaConfig())


def test_tenant_names_cannot_collide_with_the_shared_scope():
    from pydantic import ValidationError

    from common.cache.scope import SHARED_SCOPE
    from common.config import ServerConfig

    with pytest.raises(ValidationError):
        ServerConfig(api_keys={"key": SHARED_SCOPE})
    assert ServerConfig(api_keys={"key": "acme-prod.eu_1"}).api_keys == {"key": "acme-prod.eu_1"}
