"""A head restart does not take the API down: Ray's GCS keeps its state in a Redis (KubeRay's
gcsFaultToleranceOptions), the worker and router pods wait for it to come back, and the routers
run in a worker group of their own whose pods start `splitserve router`. The contract with the
entrypoints: `splitserve head` hands KubeRay's REDIS_PASSWORD to its own `ray start`, and the
router group's arguments parse with `splitserve router`'s own parser."""

from __future__ import annotations

import argparse
import copy

import pytest
from helm_python.errors import HelmRenderError, HelmValuesError

from cli.main import _add_router
from router.control.ray_node import HeadNodeConfig
from router.control.router_node import ROUTER_RESOURCE, RouterNodeConfig
from tests.unit.deploy.chart import EXAMPLES, container, example_values, find, flag, render, worker_group


def _with(example: str, **blocks) -> dict:
    values = copy.deepcopy(example_values(example))
    for key, block in blocks.items():
        values[key] = {**values.get(key, {}), **block}
    return values


def _ft(objects: list[dict]) -> dict | None:
    return find(objects, "RayCluster")["spec"].get("gcsFaultToleranceOptions")


def _env(pod_template: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod_template).get("env", [])}


def test_the_release_s_own_redis_by_default(example_objects):
    objects = example_objects["values-cpu-dev"]
    assert _ft(objects) == {"redisAddress": "splitserve-gcs-redis:6379"}
    redis = find(objects, "Deployment", "splitserve-gcs-redis")
    args = container(redis["spec"]["template"])["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction", "the GCS's keys are never evicted"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert redis["spec"]["strategy"] == {"type": "Recreate"}
    service = find(objects, "Service", "splitserve-gcs-redis")
    assert service["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    kv_tier = find(objects, "Service", "splitserve-redis")
    assert kv_tier["spec"]["selector"] != service["spec"]["selector"], "the KV tier's Redis evicts; the GCS gets its own"


def test_the_release_s_own_redis_with_a_password(example_objects):
    objects = example_objects["values-moe-ep"]
    secret_ref = {"secretKeyRef": {"name": "splitserve-gcs-redis", "key": "password"}}
    assert _ft(objects) == {"redisAddress": "splitserve-gcs-redis:6379", "redisPassword": {"valueFrom": secret_ref}}
    redis = container(find(objects, "Deployment", "splitserve-gcs-redis")["spec"]["template"])
    assert '--requirepass "$REDIS_PASSWORD"' in redis["args"][0]
    assert _env(find(objects, "Deployment", "splitserve-gcs-redis")["spec"]["template"])["REDIS_PASSWORD"] == secret_ref


def test_an_external_tls_redis_with_a_password_and_a_ca(example_objects):
    objects = example_objects["values-gpu-llama-8b"]
    assert _ft(objects) == {
        "redisAddress": "rediss://gcs-redis.llm.svc:6380",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis-auth", "key": "password"}}},
        "externalStorageNamespace": "splitserve-llama-8b",
    }
    assert not [o for o in objects if o["metadata"]["name"] == "splitserve-gcs-redis"]
    head = find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert _env(head)["RAY_REDIS_CA_CERT"] == "/etc/splitserve/gcs-redis-ca/ca.crt"
    assert {"name": "gcs-redis-ca", "mountPath": "/etc/splitserve/gcs-redis-ca", "readOnly": True} in container(head)["volumeMounts"]
    assert {"name": "gcs-redis-ca", "secret": {"secretName": "gcs-redis-ca"}} in head["spec"]["volumes"]
    assert "RAY_REDIS_ADDRESS" not in _env(head), "KubeRay sets it from redisAddress (and refuses it set twice)"


@pytest.mark.parametrize("example", EXAMPLES)
def test_worker_and_router_pods_wait_for_a_restarting_gcs(example, example_objects):
    raycluster = find(example_objects[example], "RayCluster")
    for group in ("prefill", "decode", "router"):
        assert _env(worker_group(raycluster, group)["template"])["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600", group


def test_without_fault_tolerance_nothing_of_it_is_rendered():
    objects = render.render_objects(_with("values-cpu-dev", gcsFaultTolerance={"enabled": False}))
    assert _ft(objects) is None
    assert not [o for o in objects if "gcs-redis" in o["metadata"]["name"]]
    raycluster = find(objects, "RayCluster")
    assert all("RAY_gcs_rpc_server_reconnect_timeout_s" not in _env(g["template"]) for g in raycluster["spec"]["workerGroupSpecs"])


@pytest.mark.parametrize(("block", "sentence"), [
    ({"externalAddress": "redis.example:6379"}, "gcsFaultTolerance.redis.enabled starts a Redis for the GCS and gcsFaultTolerance.externalAddress names another"),
    ({"redis": {"enabled": False}}, "gcsFaultTolerance.enabled needs a Redis: set gcsFaultTolerance.redis.enabled true or gcsFaultTolerance.externalAddress"),
    ({"redis": {"enabled": False}, "externalAddress": "redis://r:6379", "tls": {"caSecretName": "ca"}},
     "gcsFaultTolerance.tls.caSecretName is for a TLS Redis: gcsFaultTolerance.externalAddress must start with rediss://"),
])
def test_redis_settings_that_cannot_work_fail_with_a_sentence(block, sentence):
    with pytest.raises(HelmRenderError, match=sentence.replace(".", r"\.")):
        render.render(_with("values-cpu-dev", gcsFaultTolerance=block))


def test_an_external_address_that_is_no_host_and_port_is_refused_by_the_schema():
    values = _with("values-cpu-dev", gcsFaultTolerance={"redis": {"enabled": False}, "externalAddress": "redis://r:6379/0"})
    with pytest.raises(HelmValuesError, match="at '/gcsFaultTolerance/externalAddress'"):
        render.render(values)


@pytest.mark.parametrize("example", EXAMPLES)
def test_router_group_runs_splitserve_router_on_every_pod(example, example_objects):
    values = example_values(example)
    router_values = {"replicas": 2, "cpus": 2, "stopGraceS": 30, **values.get("router", {})}
    group = worker_group(find(example_objects[example], "RayCluster"), "router")
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (router_values["replicas"],) * 3
    assert group["rayStartParams"]["resources"] == f'"{{\\"{ROUTER_RESOURCE}\\": 1}}"'
    assert group["rayStartParams"]["num-gpus"] == "0"
    pod = group["template"]
    args = container(pod)["args"]
    assert container(pod)["command"] == ["splitserve"] and args[0] == "router"
    parser = argparse.ArgumentParser()
    _add_router(parser)
    parsed = parser.parse_args(args[1:])
    node = RouterNodeConfig(address=parsed.address.replace("$(FQ_RAY_IP)", "head"), router_id=parsed.router_id.replace("$(POD_NAME)", "pod"),
                            num_cpus=parsed.num_cpus, stop_grace_s=parsed.stop_grace_s)
    assert node.address == "head:6379" and node.num_cpus == router_values["cpus"]
    assert (parsed.host, parsed.port, parsed.metrics_host, parsed.metrics_port) == ("0.0.0.0", 50051, "0.0.0.0", 9400)
    assert parsed.http_port == (8000 if values.get("router", {}).get("http", {}).get("enabled") else None)
    assert pod["spec"]["terminationGracePeriodSeconds"] == int(flag(args, "--stop-grace-s")) + 30
    assert _env(pod)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "nvidia.com/gpu" not in container(pod)["resources"]["limits"]


def test_router_extra_args_reach_the_router():
    values = _with("values-cpu-dev", router={"extraArgs": ["--routing-policy", "round_robin"]})
    args = container(worker_group(find(render.render_objects(values), "RayCluster"), "router")["template"])["args"]
    assert flag(args, "--routing-policy") == "round_robin"


def test_head_hands_the_redis_password_to_ray_start():
    head = HeadNodeConfig(ray_port=6379, redis_password="s3cret", redis_username="ray")
    command = head.command("10.0.0.1")
    assert command[command.index("--redis-password") + 1] == "s3cret"
    assert command[command.index("--redis-username") + 1] == "ray"
    assert "s3cret" not in repr(head)
    assert "--redis-password" not in HeadNodeConfig().command("10.0.0.1")
    with pytest.raises(ValueError, match="ray_start_args: --redis-password is set by splitserve itself"):
        HeadNodeConfig(ray_start_args=("--redis-password", "x"))


def test_router_node_joins_with_a_router_slot_and_no_gpu():
    command = RouterNodeConfig(address="head:6379", num_cpus=2).command("10.0.0.2", "splitserve-router-x")
    assert command[command.index("--resources") + 1] == f'{{"{ROUTER_RESOURCE}": 1}}'
    assert command[command.index("--num-gpus") + 1] == "0" and command[command.index("--num-cpus") + 1] == "2"
    assert RouterNodeConfig(address="head:6379", router_id="router-a").name == "router-a"


@pytest.mark.parametrize(("fields", "message"), [
    ({"address": "head"}, "address: 'head' is not HOST:PORT"),
    ({"address": "h:1", "router_id": "a b"}, "router_id: 'a b' may hold only letters, digits"),
    ({"address": "h:1", "health_check_interval_s": 0}, "health_check_interval_s: must be > 0, got 0"),
    ({"address": "h:1", "headless_stop_s": -1}, "headless_stop_s: must be >= 0, got -1"),
    ({"address": "h:1", "ray_start_args": ("--resources", "{}")}, "ray_start_args: --resources is set by splitserve itself"),
])
def test_router_node_config_refuses_bad_values_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        RouterNodeConfig(**fields)
