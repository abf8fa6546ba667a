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


def test_a_schema_flood_sends_a_grammar_no_earlier_request_used_and_the_ingress_accepts_it():
    from common.grammar.formats import guide_from_request
    from common.protocol.openai import parse_chat_request
    from loadtest.tenants import flood_body

    bodies = [flood_body([], n) for n in range(2)]
    guides = [guide_from_request(b, PrismConfig().server.max_response_format_bytes) for b in bodies]
    assert guides[0].key != guides[1].key and all(40_000 < len(g.grammar) for g in guides)
    assert parse_chat_request(bodies[0]).guide == guides[0]
    assert "image_url" in str(flood_body(["data:image/jpeg;base64,AAAA"], 0)["messages"])


def test_where_time_went_is_the_clients_wait_outside_the_trace_and_each_spans_quantiles():
    from loadtest.tenants import where_time_went

    traces = [
        {"ttft_ms": 20.0 + i, "client_ttft_ms": 30.0 + 2 * i, "spans": [{"name": "ingress", "duration_ms": float(i)}]}
        for i in range(21)
    ]
    where = where_time_went(traces)
    assert where["outside_trace"] == {"p50_ms": 20.0, "p95_ms": 29.0}  # 10 + i
    assert where["trace_ttft"]["p50_ms"] == 30.0 and where["ingress"] == {"p50_ms": 10.0, "p95_ms": 19.0}
