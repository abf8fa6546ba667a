"""The hostile-request corpus runs against ``make serve`` with the default config (:mod:`tests.served`)."""

from __future__ import annotations

import pytest

from tests.served import API_KEY, make_serve

__all__ = ["API_KEY"]


@pytest.fixture(scope="package")
def served(model_cache, tmp_path_factory):
    with make_serve(model_cache, tmp_path_factory.mktemp("served")) as info:
        yield info
