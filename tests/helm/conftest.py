"""The chart rendered once per module with the default values and with the GPU multi-node example."""

from __future__ import annotations

import pytest

from tests.helm.chart import GPU_VALUES, render


@pytest.fixture(scope="module", params=["default", "gpu-multinode"])
def rendered(request):
    values = None if request.param == "default" else GPU_VALUES
    return request.param, values, render(values)
