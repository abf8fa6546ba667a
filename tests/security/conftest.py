"""The hostile-request corpus runs against ``make serve`` with the default config (:mod:`tests.served`), but for the
topologies: LLaVA (whose requests the corpus sends) in ``E/PD``, Qwen2-VL in ``MEPD`` inside the ingress replica
(``deployments.in_ingress``) — two ``make serve``'s default (``EPD``, tested in ``tests/defaults``) does not run
(``E/P/D``: the e2e suite's application); their answers: ``test_topologies_served.py``."""

from __future__ import annotations

import pytest

from tests.served import API_KEY, ORIGIN_KEY, OTHER_KEY, make_serve

__all__ = ["API_KEY", "IN_INGRESS", "ORIGIN_KEY", "OTHER_KEY", "TOPOLOGY"]

TOPOLOGY = {"prism-tiny-llava": "E/PD", "prism-tiny-qwen2vl": "MEPD"}
IN_INGRESS = frozenset({"prism-tiny-qwen2vl"})


@pytest.fixture(scope="package")
def served(model_cache, tmp_path_factory):
    """``make serve``, whose media stage may fetch from loopback (the front-door test's tarpit origin)."""
    work = tmp_path_factory.mktemp("served")
    with make_serve(model_cache, work, "127.0.0.1/32", TOPOLOGY, IN_INGRESS) as info:
        yield info
