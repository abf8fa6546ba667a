"""``make serve`` with the topologies set in its config (LLaVA ``E/PD``, Qwen2-VL ``MEPD`` in the ingress replica:
:mod:`.conftest`; the default ``EPD``: ``tests/defaults``): one deployment per group (none for the model in the
ingress), and the answers token for token those of the reference pipeline, with each hand-off where the topology puts
it (:mod:`tests.served_exact`)."""

from __future__ import annotations

import openai
import pytest

from common.config.topology import deployment_names
from tests.security.conftest import API_KEY, IN_INGRESS, TOPOLOGY
from tests.served import serve_processes
from tests.served_exact import CASES, check_answer, reference_models


@pytest.fixture(scope="module")
def models(model_cache):
    return reference_models(model_cache)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_each_model_runs_one_deployment_per_group_of_its_topology(served):
    names = {n.removeprefix("ServeReplica:prism:") for n in serve_processes() if n.startswith("ServeReplica:")}
    expected = {"Ingress"}
    for model, topology in TOPOLOGY.items():
        if model not in IN_INGRESS:  # (its group is built in each ingress replica: no replica of its own)
            expected |= {f"{name}-{model}" for name in deployment_names(topology)}
    assert names == expected


@pytest.mark.parametrize(("model", "kind"), CASES, ids=lambda x: str(x))
def test_the_answers_are_the_references_and_the_hops_the_topologys(models, client, model, kind):
    check_answer(client, models[model], model, kind, TOPOLOGY[model])
