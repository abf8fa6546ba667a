"""``python -m loadtest.tenants``: the application it runs is ``make serve``'s with three tenants' keys and no quota;
its figures are quantiles of what was answered."""

from __future__ import annotations

import yaml

from common.config import PrismConfig
from loadtest.tenants import KEYS, ROOT, app_config, quantiles_ms


def test_it_serves_make_serves_application_with_the_tenants_keys_and_no_quota():
    cfg = app_config()
    served = yaml.safe_load((ROOT / "ray_configs" / "local_cpu.yaml").read_text())["applications"][0]["args"]
    assert {k: v for k, v in cfg.items() if k != "server"} == {
        k: v for k, v in served["config"].items() if k != "server"
    }
    parsed = PrismConfig.model_validate(cfg)
    assert parsed.server.api_keys == KEYS and parsed.admission.tenants == {}


def test_quantiles_are_of_the_answered_probes_and_count_the_rest():
    samples = [i / 1000 for i in range(1, 101)] + [None, None]
    q = quantiles_ms(samples)
    assert q["failed"] == 2 and 50 <= q["p50_ms"] <= 51 and 95 <= q["p95_ms"] <= 96
    assert quantiles_ms([None, 0.1]) == {"p50_ms": None, "p95_ms": None, "failed": 1}  # (too few to say)
