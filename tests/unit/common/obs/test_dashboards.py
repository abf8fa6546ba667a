"""The Grafana dashboards: generated from code, committed as generated, and every PromQL expression names only
metrics and labels that the code exports (checked on the parsed expression, not by string matching)."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest

from common.obs.catalogue import BY_EXPORTED, METRICS, MetricSpec
from common.obs.dashboards import OUT_DIR, render

_SUFFIXES = ("_bucket", "_sum", "_count")


def _spec(series: str) -> tuple[MetricSpec, str]:
    """The catalogue entry behind an exported series name, and the suffix used."""
    if series in BY_EXPORTED and BY_EXPORTED[series].kind != "histogram":
        return BY_EXPORTED[series], ""
    for suffix in _SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and base in BY_EXPORTED and BY_EXPORTED[base].kind == "histogram":
            return BY_EXPORTED[base], suffix
    raise AssertionError(f"{series} is not a series of any declared metric")


def _walk(node, selectors: list, groupings: list) -> None:
    name = type(node).__name__
    if name == "VectorSelector":
        selectors.append(node)
        return
    if name == "AggregateExpr" and node.modifier is not None:
        groupings.extend(node.modifier.labels)
    if name == "BinaryExpr" and node.modifier is not None and node.modifier.matching is not None:
        groupings.extend(node.modifier.matching.labels)
    for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            _walk(child, selectors, groupings)
    for arg in getattr(node, "args", None) or ():
        _walk(arg, selectors, groupings)


def _exprs() -> list[tuple[str, str]]:
    out = []
    for file, text in render().items():
        for panel in json.loads(text)["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{file}: {panel['title']}", target["expr"]))
    return out


def _check(expr: str) -> set[str]:
    """Parse one dashboard expression; returns the catalogue metrics it uses (fails on anything unknown)."""
    concrete = expr.replace("$__rate_interval", "5m").replace("$app", "prism")
    selectors: list = []
    groupings: list = []
    _walk(promql_parser.parse(concrete), selectors, groupings)
    assert selectors, f"no metric in {expr}"
    used, labels = set(), set()
    for sel in selectors:
        spec, suffix = _spec(sel.name)
        allowed = spec.labels | ({"le"} if suffix == "_bucket" else set())
        for matcher in sel.matchers.matchers:
            assert matcher.name in allowed, f"{sel.name} has no label {matcher.name!r} ({expr})"
        used.add(spec.name)
        labels |= allowed
    unknown = set(groupings) - labels
    assert not unknown, f"grouping by labels no metric here has: {unknown} ({expr})"
    return used


def test_committed_dashboards_are_the_generated_ones():
    for name, text in render().items():
        assert (OUT_DIR / name).read_text(encoding="utf-8") == text, f"run `make dashboards` ({name} is stale)"


@pytest.mark.parametrize(("where", "expr"), _exprs())
def test_every_expression_refers_to_exported_metrics_and_labels(where, expr):
    _check(expr)


def test_dashboards_cover_every_declared_metric_and_variables_resolve():
    used = set().union(*(_check(expr) for _, expr in _exprs()))
    assert used == {m.name for m in METRICS}
    for text in render().values():
        for var in json.loads(text)["templating"]["list"]:
            if var["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]).groups()
                assert label in _spec(metric)[0].labels


def test_the_checker_rejects_unknown_metrics_and_labels():
    with pytest.raises(AssertionError):
        _check('sum(rate(ray_prism_requests_totl{application="$app"}[$__rate_interval]))')
    with pytest.raises(AssertionError):
        _check('sum(ray_prism_kv_blocks_used{tenant="a"})')
    with pytest.raises(AssertionError):
        _check("sum by (cache) (ray_prism_kv_blocks_used)")
    with pytest.raises(AssertionError):
        _check("ray_prism_ttft_seconds")  # a histogram is only scraped as _bucket/_sum/_count
