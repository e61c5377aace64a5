"""Helpers of the chart checks: render deploy/helm/splitserve with helm-python-sdk (no helm
binary, no cluster) through deploy/helm/render.py, and pick objects out of a render."""

from __future__ import annotations

import sys
from pathlib import Path

HELM_DIR = Path(__file__).resolve().parents[3] / "deploy" / "helm"
if str(HELM_DIR) not in sys.path:
    sys.path.insert(0, str(HELM_DIR))

import render  # noqa: E402

EXAMPLES = render.example_names()
KUBERNETES_VERSION = "1.37"
"""The newest Kubernetes schema kubernetes-validate 1.37.0 ships (the chart needs 1.30+)."""


def example_values(name: str, **overrides) -> dict:
    """An example's values with top-level blocks replaced by ``overrides``."""
    values = render.load_values(render.EXAMPLES_DIR / f"{name}.yaml")
    values.update(overrides)
    return values


def render_example(name: str, **overrides) -> list[dict]:
    """The objects an example renders to (see example_values)."""
    return render.render_objects(example_values(name, **overrides))


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    """The one object of ``kind`` (and ``name``); fails naming what was rendered instead."""
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    present = sorted(f'{o["kind"]}/{o["metadata"]["name"]}' for o in objects)
    assert len(matches) == 1, f"expected one {kind} {name or ''}, rendered: {present}"
    return matches[0]


def worker_group(raycluster: dict, pool: str) -> dict:
    """The RayCluster's worker group named ``pool``."""
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    return groups[pool]


def container(pod_template: dict) -> dict:
    """The first (Ray) container of a pod template."""
    return pod_template["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in a container's args."""
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]
