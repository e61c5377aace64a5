"""The planner's Deployment points at this release's RayCluster and router, with the worker
groups' bounds, and its Role allows exactly the calls planner/connectors/kubernetes.py makes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cli.args import dataclass_from_args
from cli.plan import add_plan
from planner.config import PlannerConfig
from planner.connectors import kubernetes as connector
from tests.unit.deploy.chart import EXAMPLES, container, example_values, find, render, render_example, worker_group

PLANNED = [e for e in EXAMPLES if example_values(e).get("planner", {}).get("enabled", True)]


def _planner_pod(objects: list[dict]) -> dict:
    return find(objects, "Deployment", "splitserve-planner")["spec"]["template"]


def _plan_args(objects: list[dict]) -> argparse.Namespace:
    args = container(_planner_pod(objects))["args"]
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
    defaults = render.load_values(render.CHART_DIR / "values.yaml")["planner"]
    assert config.interval_s == {**defaults, **example_values(example).get("planner", {})}["intervalS"]


def test_extra_args_reach_the_planners_settings():
    """planner.extraArgs is how a release sets what has no value of its own, e.g. the scale-down window."""
    planner = {**example_values("values-cpu-dev").get("planner", {}), "extraArgs": ["--scale-down-window-s", "300", "--scale-down-margin", "0.9"]}
    config = dataclass_from_args(PlannerConfig, _plan_args(render_example("values-cpu-dev", planner=planner)))
    assert (config.scale_down_window_s, config.scale_down_margin) == (300.0, 0.9)


def _mounted_secret_item(pod: dict, path: Path) -> tuple[str, str]:
    """(Secret name, key) of the Secret item the planner container sees at ``path``."""
    mounts = {m["mountPath"]: m for m in container(pod)["volumeMounts"]}
    mount = mounts[str(path.parent)]
    assert mount["readOnly"] is True
    volume = {v["name"]: v for v in pod["spec"]["volumes"]}[mount["name"]]
    items = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    return volume["secret"]["secretName"], items[path.name]


def test_planner_reads_the_routers_ca_and_token_from_its_mounts(example_objects):
    pod = _planner_pod(example_objects["values-moe-ep"])
    args = _plan_args(example_objects["values-moe-ep"])
    assert [a for a in container(pod)["args"] if a in ("--tls-ca", "--token-file")] == ["--tls-ca", "--token-file"]
    assert args.tls_ca == Path("/etc/splitserve/tls/ca.crt")
    assert args.token_file == Path("/etc/splitserve/auth/token")
    assert _mounted_secret_item(pod, args.tls_ca) == ("splitserve-api-tls", "ca.crt")
    assert _mounted_secret_item(pod, args.token_file) == ("splitserve-api-token", "token")
    assert [v["secret"]["items"] for v in pod["spec"]["volumes"]] == [
        [{"key": "ca.crt", "path": "ca.crt"}], [{"key": "token", "path": "token"}]], "the TLS key stays out"


def test_planner_follows_the_ca_key_and_mounts_only_what_is_on():
    values = example_values("values-moe-ep")
    objects = render_example("values-moe-ep", tls={**values["tls"], "caKey": "root.pem"},
                             auth={**values["auth"], "enabled": False})
    pod = _planner_pod(objects)
    args = _plan_args(objects)
    assert args.tls_ca == Path("/etc/splitserve/tls/root.pem") and args.token_file is None
    assert _mounted_secret_item(pod, args.tls_ca) == ("splitserve-api-tls", "root.pem")
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["tls"]


def test_planner_without_tls_or_auth_mounts_nothing(example_objects):
    pod = _planner_pod(example_objects["values-cpu-dev"])
    args = _plan_args(example_objects["values-cpu-dev"])
    assert args.tls_ca is None and args.token_file is None
    assert "volumes" not in pod["spec"] and "volumeMounts" not in container(pod)


def test_planner_is_the_only_replica(example_objects):
    deployment = find(example_objects["values-cpu-dev"], "Deployment", "splitserve-planner")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_without_the_planner_there_is_no_rbac():
    objects = render_example("values-moe-ep", planner={"enabled": False})
    assert not {o["kind"] for o in objects} & {"Role", "RoleBinding", "ServiceAccount"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"] == ["splitserve-gcs-redis"]
