"""The hostile-request corpus runs against ``make serve`` with the default config (:mod:`tests.served`), but for the
topologies: LLaVA (whose requests the corpus sends) in ``E/PD``, Qwen2-VL in ``E/P/D`` — the two ``make serve``'s
default (``EPD``, tested in ``tests/defaults``) does not run; their answers: ``test_topologies_served.py``."""

from __future__ import annotations

import pytest

from tests.served import API_KEY, ORIGIN_KEY, OTHER_KEY, make_serve

__all__ = ["API_KEY", "ORIGIN_KEY", "OTHER_KEY", "TOPOLOGY"]

TOPOLOGY = {"prism-tiny-llava": "E/PD", "prism-tiny-qwen2vl": "E/P/D"}


@pytest.fixture(scope="package")
def served(model_cache, tmp_path_factory):
    """``make serve``, whose media stage may fetch from loopback (the front-door test's tarpit origin)."""
    work = tmp_path_factory.mktemp("served")
    with make_serve(model_cache, work, private_media="127.0.0.1/32", topology=TOPOLOGY) as info:
        yield info
