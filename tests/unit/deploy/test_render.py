"""The chart renders and lints clean with Helm as a library, and every generated file (goldens,
values.schema.json, dashboard) matches what the code builds now."""

from __future__ import annotations

import shutil

import pytest
from helm_python.chart import lint

from tests.unit.deploy.chart import EXAMPLES, example_values, render


def test_there_are_four_examples():
    assert EXAMPLES == ["values-cpu-dev", "values-gpu-70b-tp", "values-gpu-llama-8b", "values-moe-ep"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_golden_matches_render(example):
    golden = render.GOLDEN_DIR / f"{example}.yaml"
    assert golden.read_text() == render.golden_text(example), (
        f"{golden.name} differs from a fresh render of examples/{example}.yaml: run `make chart` and commit the diff")


@pytest.mark.parametrize("path", sorted(render.generated_files(), key=str), ids=lambda p: p.name)
def test_generated_file_is_current(path):
    assert path.read_text() == render.generated_files()[path], f"{path.name} is stale: run `make chart`"


@pytest.mark.parametrize("example", EXAMPLES)
def test_lint_reports_no_errors_or_warnings(example):
    report = lint(render.CHART_DIR, example_values(example), strict=True, namespace=render.NAMESPACE, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems


def test_lint_fails_on_values_the_schema_refuses():
    report = lint(render.CHART_DIR, example_values("values-cpu-dev", gpusPerNode="8"))
    assert any("/gpusPerNode" in e and "want integer" in e for e in report["errors"]), report


def test_golden_check_catches_an_edited_template(tmp_path, monkeypatch):
    """The golden test means something: the same render from an edited copy of the chart differs."""
    chart = tmp_path / "splitserve"
    shutil.copytree(render.CHART_DIR, chart)
    template = chart / "templates" / "service-router.yaml"
    template.write_text(template.read_text().replace("appProtocol: grpc", "appProtocol: h2c"))
    monkeypatch.setattr(render, "CHART_DIR", chart)
    assert render.golden_text("values-cpu-dev") != (render.GOLDEN_DIR / "values-cpu-dev.yaml").read_text()
