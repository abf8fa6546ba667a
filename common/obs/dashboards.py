"""The Grafana dashboards, generated from code so every query is built from the metric catalogue.

``python -m common.obs.dashboards [OUT_DIR]`` writes ``prism-stages.json`` (one row per stage: replicas running vs
wanted, queue depth vs in flight, queue-wait and work latency — the autoscaling picture) and ``prism-requests.json``
(TTFT / ITL / E2E percentiles, outcomes by code, cache hit rates, KV use, tokens per request, hand-off bandwidth) to
``helm/prism/dashboards/`` — the files the Helm chart provisions and that can be imported into Grafana by hand.
A test regenerates them and fails if the committed files differ, and checks every PromQL expression against the
catalogue (metric names, label names).

Queries filter on the ``application`` label (dashboard variable ``$app``), so several Prism apps on one cluster do
not mix. ``$__rate_interval`` is Grafana's rate window.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from common.obs.catalogue import BY_NAME, STAGES

OUT_DIR = Path(__file__).resolve().parents[2] / "helm" / "prism" / "dashboards"
RATE = "$__rate_interval"
APP = 'application="$app"'
DS = {"type": "prometheus", "uid": "${datasource}"}


def m(name: str, suffix: str = "") -> str:
    """The exported name of a catalogue metric (so a renamed metric breaks generation, not a dashboard)."""
    return BY_NAME[name].exported + suffix


def quantile(q: float, metric: str, sel: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({q}, sum by ({group}) (rate({m(metric, '_bucket')}{{{sel}}}[{RATE}])))"


class _Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to new rows."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append(
            {"type": "row", "title": title, "id": self._id(), "collapsed": False, "gridPos": _pos(0, self.y, 24, 1)}
        )
        self.y += 1

    def panel(
        self, title: str, targets: list[tuple[str, str]], unit: str = "short", width: int = 8, desc: str = ""
    ) -> None:
        if self.x + width > 24:
            self.x, self.y = 0, self.y + 8
        self.panels.append(
            {
                "type": "timeseries",
                "title": title,
                "description": desc,
                "id": self._id(),
                "datasource": DS,
                "gridPos": _pos(self.x, self.y, width, 8),
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        self.x += width

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _pos(x: int, y: int, w: int, h: int) -> dict[str, int]:
    return {"x": x, "y": y, "w": w, "h": h}


def _dashboard(uid: str, title: str, layout: _Layout) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "tags": ["prism"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "app",
                    "type": "query",
                    "label": "Application",
                    "datasource": DS,
                    "query": f"label_values({m('prism_replicas')}, application)",
                    "refresh": 2,
                },
            ]
        },
        "panels": layout.panels,
    }


def stages_dashboard() -> dict[str, Any]:
    lay = _Layout()
    for stage in STAGES:
        sel = f'{APP}, stage="{stage}"'
        lay.row(f"{stage}")
        lay.panel(
            "Replicas: running vs wanted",
            [
                (f"sum({m('prism_replicas')}{{{sel}}})", "running"),
                (f"max({m('prism_autoscale_desired_replicas')}{{{sel}}})", "wanted by the policy"),
            ],
            desc="Running replicas, and what the queue-depth policy asks for (only on autoscaled stages).",
        )
        lay.panel(
            "Queue depth vs in flight",
            [
                (f"sum({m('prism_stage_queue_depth')}{{{sel}}})", "queue depth (autoscaling unit)"),
                (f"sum({m('prism_stage_in_flight')}{{{sel}}})", "requests in flight"),
            ],
            desc="The autoscaling signal in the stage's own unit (media: items, encode: patches, prefill: "
            "prompt tokens, decode: sequences) next to requests inside the stage.",
        )
        work = [(quantile(q, "prism_stage_work_seconds", sel), f"work p{int(q * 100)}") for q in (0.5, 0.95)]
        if stage == "ingress":  # Serve's own queue in front of the ingress is not visible from inside it
            lay.panel("Latency: parse + auth + limits (p50 / p95)", work, unit="s")
        else:
            queue = [(quantile(q, "prism_stage_queue_seconds", sel), f"queue p{int(q * 100)}") for q in (0.5, 0.95)]
            lay.panel(
                "Latency: queue wait vs work (p50 / p95)",
                queue + work,
                unit="s",
                desc="Queue wait (hand-off + routing + engine queue) rising while work stays flat: add replicas.",
            )
        if stage == "decode":
            lay.panel(
                "KV blocks",
                [
                    (f"sum({m('prism_kv_blocks_used')}{{{APP}}})", "used"),
                    (f"sum({m('prism_kv_blocks_free')}{{{APP}}})", "free"),
                ],
                width=12,
            )
            lay.panel(
                "KV pool used fraction",
                [
                    (
                        f"sum({m('prism_kv_blocks_used')}{{{APP}}}) / (sum({m('prism_kv_blocks_used')}{{{APP}}})"
                        f" + sum({m('prism_kv_blocks_free')}{{{APP}}}))",
                        "used / total",
                    )
                ],
                unit="percentunit",
                width=12,
            )
    return _dashboard("prism-stages", "Prism / Stages and autoscaling", lay)


def requests_dashboard() -> dict[str, Any]:
    lay = _Layout()
    lay.row("Latency")
    for metric, title in (("prism_ttft_seconds", "TTFT"), ("prism_itl_seconds", "ITL"), ("prism_e2e_seconds", "E2E")):
        lay.panel(
            f"{title} p50 / p95 / p99",
            [(quantile(q, metric, APP), f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)],
            unit="s",
        )
    lay.row("Traffic and outcomes")
    lay.panel(
        "Requests by outcome",
        [(f"sum by (status, code) (rate({m('prism_requests_total')}{{{APP}}}[{RATE}]))", "{{status}} {{code}}")],
        unit="reqps",
        width=12,
    )
    lay.panel(
        "Rejected share (429 + 5xx + 504)",
        [
            (
                f'sum(rate({m("prism_requests_total")}{{{APP}, status=~"429|5.."}}[{RATE}]))'
                f" / sum(rate({m('prism_requests_total')}{{{APP}}}[{RATE}]))",
                "rejected / all",
            )
        ],
        unit="percentunit",
        width=12,
    )
    lay.panel(
        "Decode migrations by outcome",
        [
            (f"sum by (outcome) (rate({m('prism_migrations_total')}{{{APP}}}[{RATE}]))", "{{outcome}}"),
            (
                f"sum by (from_deployment) (rate({m('prism_replicas_left_total')}{{{APP}}}[{RATE}]))",
                "replicas left {{from_deployment}}",
            ),
        ],
        unit="reqps",
        desc="resumed: a stream whose decode replica was lost, or left (scale-down, update, drain: moved after "
        "server.drain_grace_s), went on on a live one, unseen by its client; failed: the rebuilt stream ended before "
        "a new token; refused: server.max_migrations spent or no time left (the client got an error). Replicas left: "
        "decode replicas the ingress saw leave their deployment's routing set.",
    )
    lay.row("Admission")
    lay.panel(
        "Refused by stage and reason",
        [
            (
                f'sum by (stage, reason) (rate({m("prism_admission_total")}{{{APP}, result="refused"}}[{RATE}]))',
                "{{stage}} {{reason}}",
            )
        ],
        unit="reqps",
        desc="front: a tenant's queue at a Serve proxy full while it held its share of the places (tenant_share); "
        "ingress: per-request limits and tenant quotas; media / encode / prefill: the stage's budget; decode: "
        "its KV pool "
        "(budget_full: 429, deadline: would wait past it).",
    )
    lay.panel(
        "Admitted vs refused by tenant",
        [
            (
                f'sum by (tenant, result) (rate({m("prism_admission_total")}{{{APP}, stage="ingress"}}[{RATE}]))',
                "{{tenant}} {{result}}",
            )
        ],
        unit="reqps",
    )
    lay.panel(
        "In flight by tenant",
        [(f"sum by (tenant) ({m('prism_tenant_in_flight')}{{{APP}}})", "{{tenant}}")],
    )
    lay.panel(
        "Budget wait p95 by stage and class",
        [(quantile(0.95, "prism_admission_wait_seconds", APP, by="stage, class"), "{{stage}} {{class}}")],
        unit="s",
        desc="Time requests wait for room in a stage's budget; batch class should absorb the waiting.",
    )
    lay.panel(
        "Share of each stage's service by tenant",
        [
            (
                f"sum by (stage, tenant) (rate({m('prism_admission_units_total')}{{{APP}}}[{RATE}]))"
                f" / ignoring (tenant) group_left sum by (stage) (rate({m('prism_admission_units_total')}"
                f"{{{APP}}}[{RATE}]))",
                "{{stage}} {{tenant}}",
            )
        ],
        unit="percentunit",
        desc="Each tenant's part of the units a stage granted (pixels, patches, prompt tokens, KV blocks). Under "
        "contention fair sharing keeps the shares to the tenants' weights (admission.tenants.<name>.weight); a "
        "tenant alone may take all of it.",
    )
    lay.panel(
        "Budget wait p95 by tenant",
        [(quantile(0.95, "prism_admission_wait_seconds", APP, by="stage, tenant"), "{{stage}} {{tenant}}")],
        unit="s",
        desc="A tenant that floods a stage waits in its own queue: the others' waits should stay low. front: the "
        "wait for a place at a Serve proxy (a tenant at its share of them, its body unread).",
    )
    lay.row("Caches")
    lay.panel(
        "Hit rate by layer",
        [
            (
                f'sum by (cache) (rate({m("prism_cache_lookups_total")}{{{APP}, result="hit"}}[{RATE}]))'
                f" / sum by (cache) (rate({m('prism_cache_lookups_total')}{{{APP}}}[{RATE}]))",
                "{{cache}}",
            )
        ],
        unit="percentunit",
        width=12,
        desc="processor and encoder count media items; prefix counts KV blocks.",
    )
    lay.panel(
        "Bytes held by layer",
        [(f"sum by (cache) ({m('prism_cache_bytes')}{{{APP}}})", "{{cache}}")],
        unit="bytes",
        width=12,
    )
    lay.panel(
        "Affinity routing by stage and outcome",
        [
            (
                f"sum by (stage, outcome) (rate({m('prism_route_affinity_total')}{{{APP}}}[{RATE}]))",
                "{{stage}} {{outcome}}",
            )
        ],
        unit="reqps",
        desc="owner: to the replica that holds the key; new: a key placed; spilled: its replica was over the load "
        "bound; moved: its replica left. A high spilled share means hot keys — or too few replicas.",
    )
    lay.row("Tokens and hand-offs")
    lay.panel(
        "Mean tokens per request",
        [
            (
                f"sum(rate({m(name, '_sum')}{{{APP}}}[{RATE}])) / sum(rate({m(name, '_count')}{{{APP}}}[{RATE}]))",
                label,
            )
            for name, label in (
                ("prism_prompt_tokens", "prompt"),
                ("prism_visual_tokens", "visual"),
                ("prism_output_tokens", "output"),
            )
        ],
    )
    lay.panel(
        "Hand-off bandwidth by backend",
        [
            (
                f"sum by (backend, payload) (rate({m('prism_transfer_bytes_total')}{{{APP}}}[{RATE}]))",
                "{{backend}} {{payload}}",
            )
        ],
        unit="Bps",
    )
    lay.panel(
        "Hand-off time p95",
        [(quantile(0.95, "prism_transfer_seconds", APP, by="backend, payload"), "{{backend}} {{payload}}")],
        unit="s",
    )
    lay.row("Structured outputs")
    lay.panel(
        "Grammar compiles by result",
        [
            (
                f"sum by (result) (rate({m('prism_grammar_compiles_total')}{{{APP}}}[{RATE}]))",
                "{{result}}",
            ),
        ],
        unit="ops",
        desc="cached: a compiled grammar reused (the cache is per replica, keyed by the constraint and tokenizer); "
        "refused: a 400 before any stage ran.",
    )
    lay.panel(
        "Mean compile time",
        [
            (
                f"sum(rate({m('prism_grammar_compile_seconds_total')}{{{APP}}}[{RATE}]))"
                f' / sum(rate({m("prism_grammar_compiles_total")}{{{APP}, result!="cached"}}[{RATE}]))',
                "compile",
            )
        ],
        unit="s",
    )
    lay.panel(
        "Mask time per constrained decode step",
        [
            (
                f"sum by (deployment) (rate({m('prism_grammar_mask_seconds_total')}{{{APP}}}[{RATE}]))"
                f" / sum by (deployment) (rate({m('prism_grammar_masked_steps_total')}{{{APP}}}[{RATE}]))",
                "{{deployment}}",
            )
        ],
        unit="s",
        desc="Compare with the step time: the grammar's overhead on a batch that holds constrained sequences.",
    )
    return _dashboard("prism-requests", "Prism / Requests, caches and KV", lay)


DASHBOARDS = {"prism-stages.json": stages_dashboard, "prism-requests.json": requests_dashboard}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (out / name).write_text(text, encoding="utf-8")
        print(out / name)


if __name__ == "__main__":
    main(sys.argv[1:])
