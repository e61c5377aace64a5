"""The planner's Deployment points at this release's RayCluster and router, with the worker
groups' bounds, and its Role allows exactly the calls planner/connectors/kubernetes.py makes."""

from __future__ import annotations

import argparse

import pytest

from planner.cli import add_plan
from planner.config import PlannerConfig
from planner.connectors import kubernetes as connector
from router.cli_args import dataclass_from_args
from tests.unit.deploy.chart import EXAMPLES, container, example_values, find, render, worker_group

PLANNED = [e for e in EXAMPLES if example_values(e).get("planner", {}).get("enabled", True)]


def _plan_args(objects: list[dict]) -> argparse.Namespace:
    args = container(find(objects, "Deployment", "splitserve-planner")["spec"]["template"])["args"]
    assert args[0] == "plan"
    parser = argparse.ArgumentParser()
    add_plan(parser)
    return parser.parse_args(args[1:])


@pytest.mark.parametrize("example", PLANNED)
def test_role_allows_exactly_what_the_connector_calls(example, example_objects):
    role = find(example_objects[example], "Role", "splitserve-planner")
    assert role["rules"] == [
        {"apiGroups": [connector.RAYCLUSTER_GROUP], "resources": [connector.RAYCLUSTER_PLURAL],
         "resourceNames": ["splitserve"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]


@pytest.mark.parametrize("example", PLANNED)
def test_role_is_bound_to_the_planners_service_account(example, example_objects):
    objects = example_objects[example]
    binding = find(objects, "RoleBinding", "splitserve-planner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "splitserve-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "splitserve-planner", "namespace": render.NAMESPACE}]
    find(objects, "ServiceAccount", "splitserve-planner")
    pod = find(objects, "Deployment", "splitserve-planner")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "splitserve-planner"
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


@pytest.mark.parametrize("example", PLANNED)
def test_planner_command_parses_and_matches_the_groups(example, example_objects):
    objects = example_objects[example]
    args = _plan_args(objects)
    raycluster = find(objects, "RayCluster")
    assert args.connector == "kubernetes"
    assert args.raycluster == raycluster["metadata"]["name"]
    assert args.kube_namespace == render.NAMESPACE
    assert args.addr == "splitserve-router:50051"
    find(objects, "Service", "splitserve-router")
    for pool in ("prefill", "decode"):
        group = worker_group(raycluster, pool)
        assert group["groupName"] == connector.DEFAULT_GROUP_NAMES[pool]
        assert getattr(args, f"min_{pool}") == group["minReplicas"]
        assert getattr(args, f"max_{pool}") == group["maxReplicas"]
    config = dataclass_from_args(PlannerConfig, args)  # the planner's own checks of its settings
    assert config.interval_s == example_values(example)["planner"]["intervalS"]


def test_planner_is_the_only_replica(example_objects):
    deployment = find(example_objects["values-cpu-dev"], "Deployment", "splitserve-planner")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_without_the_planner_there_is_no_rbac(example_objects):
    kinds = {o["kind"] for o in example_objects["values-moe-ep"]}
    assert not kinds & {"Deployment", "Role", "RoleBinding", "ServiceAccount"}
