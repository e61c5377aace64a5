"""The Grafana dashboard ships in a ConfigMap the sidecar picks up, covers what operators
watch, and every PromQL expression in it names only series the code really exports."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit.deploy.chart import EXAMPLES, find, render
from tests.unit.deploy.exported_metrics import exported_metric_names

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "le", "inf", "nan"}
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions or
    aggregations (followed by '('), label matchers ({...}), grouping labels (by/without (...)),
    ranges ([...]), strings, numbers and durations (5m) or keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end():].lstrip()
        if rest.startswith("(") or match.group().lower() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def is_exported(name: str, exported: frozenset[str]) -> bool:
    """``name`` is an exported series, or one with a Prometheus suffix added to an exported family
    (a labelled family with no children yet is collected by its family name alone)."""
    return name in exported or any(name.endswith(s) and name.removesuffix(s) in exported for s in SUFFIXES)


def _dashboard() -> dict:
    return json.loads(render.DASHBOARD_FILE.read_text())


def _exprs() -> list[str]:
    return [t["expr"] for panel in _dashboard()["panels"] for t in panel["targets"]]


def test_metric_names_parser():
    expr = 'histogram_quantile(0.9, sum by (le, pool) (rate(a_bucket{status!="OK",x=~"y(z)"}[5m]))) / on (pool) sum without (router) (b_total offset 5m)'
    assert metric_names(expr) == {"a_bucket", "b_total"}


def test_the_code_exports_the_series_the_planner_and_router_are_known_by():
    names = exported_metric_names()
    for name in ("splitserve_time_to_first_token_seconds_bucket", "splitserve_requests_total",
                 "splitserve_planner_desired_replicas", "splitserve_kv_handoff_bytes_sent_total",
                 "splitserve_kv_tier_hits_total", "splitserve_replicas"):
        assert is_exported(name, names), name


@pytest.mark.parametrize("expr", _exprs())
def test_every_expression_names_exported_series(expr):
    names = metric_names(expr)
    assert names, f"no metric in {expr!r}"
    exported = exported_metric_names()
    unknown = sorted(n for n in names if not is_exported(n, exported))
    assert not unknown, f"{unknown} in {expr!r}: no such series is exported"


def test_a_misspelt_series_would_be_caught():
    exported = exported_metric_names()
    assert is_exported("splitserve_time_to_first_token_seconds_bucket", exported)
    assert not is_exported("splitserve_time_to_first_token_bucket", exported)
    assert not is_exported("splitserve_requests_inflight_total_total", exported)


def test_dashboard_covers_what_operators_watch():
    text = " ".join(p["title"] for p in _dashboard()["panels"]).lower()
    for topic in ("time to first token", "inter-token latency", "requests per second", "prefix-cache hit rate",
                  "per tier", "hand-off time", "hand-off bytes", "desired vs actual", "queue depth", "errors"):
        assert topic in text, f"no panel about {topic}"
    exprs = " ".join(_exprs())
    assert "splitserve_planner_desired_replicas" in exprs and 'splitserve_replicas{healthy="true"}' in exprs
    assert all(f"histogram_quantile({q}" in exprs for q in ("0.5", "0.9", "0.99"))


@pytest.mark.parametrize("example", EXAMPLES)
def test_dashboard_configmap_is_labelled_for_the_sidecar(example, example_objects):
    configmap = find(example_objects[example], "ConfigMap", "splitserve-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["splitserve.json"]) == _dashboard()
