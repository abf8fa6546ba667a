"""The default application as ``make serve`` deploys it (both tiny models), for the tests of what it serves."""

from __future__ import annotations

import pytest

from tests.served import make_serve


@pytest.fixture(scope="package")
def served(model_cache, tmp_path_factory):
    with make_serve(model_cache, tmp_path_factory.mktemp("defaults")) as info:
        yield info
