"""The hostile-request corpus runs against ``make serve`` with the default config (:mod:`tests.served`)."""

from __future__ import annotations

import pytest

from tests.served import API_KEY, ORIGIN_KEY, OTHER_KEY, make_serve

__all__ = ["API_KEY", "ORIGIN_KEY", "OTHER_KEY"]


@pytest.fixture(scope="package")
def served(model_cache, tmp_path_factory):
    """``make serve``, whose media stage may fetch from loopback (the front-door test's tarpit origin)."""
    with make_serve(model_cache, tmp_path_factory.mktemp("served"), private_media="127.0.0.1/32") as info:
        yield info
