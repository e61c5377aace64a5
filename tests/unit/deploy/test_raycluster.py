"""The RayCluster follows the contract with the entrypoints: one image, our own commands
(KubeRay's `ray start` switched off), a head with the controller and no router, a prefill and a
decode worker group whose pods request their replica's GPUs, advertise their pool's Ray
resource, and drain before they are killed, and a router group behind the router Service."""

from __future__ import annotations

import argparse

import pytest

from cli.main import _add_node_cert, _add_router, _add_up, _add_worker
from router.control.controller import pool_resource
from tests.unit.deploy.chart import EXAMPLES, container, example_values, find, flag, render, render_example, worker_group

HEAD_ONLY_FLAGS = {"--ray-port"}
"""Flags of `splitserve head` that `splitserve up` does not have (the contract's additions)."""


def _up_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    _add_up(parser)
    return {s for action in parser._actions for s in action.option_strings}


@pytest.mark.parametrize("example", EXAMPLES)
def test_kuberay_runs_our_commands_and_its_autoscaler_is_off(example, example_objects):
    raycluster = find(example_objects[example], "RayCluster")
    assert raycluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert raycluster["spec"]["enableInTreeAutoscaling"] is False
    assert [g["groupName"] for g in raycluster["spec"]["workerGroupSpecs"]] == ["prefill", "decode", "router"]
    templates = [raycluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in raycluster["spec"]["workerGroupSpecs"]]
    images = {container(t)["image"] for t in templates}
    assert len(images) == 1


@pytest.mark.parametrize("example", EXAMPLES)
def test_head_command(example, example_objects):
    values = example_values(example)
    head = container(find(example_objects[example], "RayCluster")["spec"]["headGroupSpec"]["template"])
    args = head["args"]
    assert head["command"] == ["splitserve"] and args[0] == "head"
    assert flag(args, "--model") == values["model"]["name"]
    assert flag(args, "--ray-port") == "6379" and flag(args, "--routers") == "0", "the routers run in their own group"
    assert not {"--port", "--host", "--http-port", "--metrics-port", "--tls-cert", "--token-file"} & set(args)
    assert flag(args, "--prefill-tp") == str(values["prefill"].get("tp", 1))
    assert flag(args, "--decode-tp") == str(values["decode"].get("tp", 1))
    assert flag(args, "--decode-ep") == str(values["decode"].get("ep", 1))
    assert "--prefill-pp" not in args and "--decode-pp" not in args, "pp 1 is the CLI's default"
    assert "--prefill" not in args and "--decode" not in args, "pool sizes belong to the worker groups"
    unknown = {a for a in args if a.startswith("--")} - _up_flags() - HEAD_ONLY_FLAGS
    assert not unknown, f"flags neither `splitserve up` nor the head contract know: {unknown}"


def test_a_pipelined_pool_holds_every_stage_of_a_replica_on_its_pod():
    """prefill pp 2 x tp 2 and decode pp 2 x tp 4 on 8-GPU nodes: the head starts the pools
    pipelined and each pod requests the GPUs of its replica's every stage (4 and 8)."""
    values = example_values("values-gpu-70b-tp", redis={"enabled": False, "externalUrl": ""})
    values["engine"] = {**values["engine"], "cpuKvCacheBytes": 0}  # the tiers serve one-stage replicas so far
    values["prefill"] = {**values["prefill"], "tp": 2, "pp": 2}
    values["decode"] = {**values["decode"], "tp": 4, "pp": 2}
    raycluster = find(render.render_objects(values), "RayCluster")
    args = container(raycluster["spec"]["headGroupSpec"]["template"])["args"]
    assert (flag(args, "--prefill-pp"), flag(args, "--decode-pp")) == ("2", "2")
    assert (flag(args, "--prefill-tp"), flag(args, "--decode-tp")) == ("2", "4")
    assert not {a for a in args if a.startswith("--")} - _up_flags() - HEAD_ONLY_FLAGS
    for pool, gpus in (("prefill", "4"), ("decode", "8")):
        group = worker_group(raycluster, pool)
        worker = container(group["template"])
        assert flag(worker["args"], "--num-gpus") == gpus and group["rayStartParams"]["num-gpus"] == gpus
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus == worker["resources"]["requests"]["nvidia.com/gpu"]


@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_worker_group(example, pool, example_objects):
    values = example_values(example)
    p = values[pool]
    size = max(p.get("tp", 1) * p.get("pp", 1), p.get("ep", 1))
    gpus = size if values["gpusPerNode"] > 0 else 0
    group = worker_group(find(example_objects[example], "RayCluster"), pool)
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (p["replicas"], p["minReplicas"], p["maxReplicas"])
    pod = group["template"]["spec"]
    worker = container(group["template"])
    args = worker["args"]
    assert args[:3] == ["worker", "--pool", pool]
    assert flag(args, "--address") == "$(FQ_RAY_IP):6379"
    assert flag(args, "--num-gpus") == str(gpus)
    assert flag(args, "--num-cpus") == str(p["cpus"])
    drain_s = int(flag(args, "--drain-timeout-s"))
    assert pod["terminationGracePeriodSeconds"] == drain_s + 30
    for side in ("requests", "limits"):
        assert worker["resources"][side].get("nvidia.com/gpu") == (str(gpus) if gpus else None)
    assert group["rayStartParams"]["resources"] == f'"{{\\"{pool_resource(pool)}\\": 1}}"'
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert pod.get("tolerations", []) == p.get("tolerations", [])
    assert pod.get("nodeSelector", {}) == p.get("nodeSelector", {})


def test_prefill_may_scale_to_zero(example_objects):
    group = worker_group(find(example_objects["values-gpu-llama-8b"], "RayCluster"), "prefill")
    assert group["minReplicas"] == 0


def test_model_from_a_claim_is_mounted_read_only_in_every_pod(example_objects):
    raycluster = find(example_objects["values-gpu-llama-8b"], "RayCluster")
    for template in [raycluster["spec"]["headGroupSpec"]["template"]] + [worker_group(raycluster, p)["template"] for p in ("prefill", "decode")]:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(template)["volumeMounts"]


def test_model_baked_into_the_image_mounts_no_claim(example_objects):
    raycluster = find(example_objects["values-moe-ep"], "RayCluster")
    assert "model" not in {v["name"] for v in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert flag(container(raycluster["spec"]["headGroupSpec"]["template"])["args"], "--model") == "/opt/models/Qwen3-30B-A3B"


def test_the_router_pods_need_no_model(example_objects):
    router = worker_group(find(example_objects["values-gpu-llama-8b"], "RayCluster"), "router")["template"]
    assert "model" not in {v["name"] for v in router["spec"]["volumes"]}
    assert "--model" not in container(router)["args"], "a router fetches tokenizer files from a decode replica"


def test_tls_and_token_come_from_secrets(example_objects):
    router = worker_group(find(example_objects["values-moe-ep"], "RayCluster"), "router")["template"]
    volumes = {v["name"]: v for v in router["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "splitserve-api-tls"
    assert volumes["auth"]["secret"]["secretName"] == "splitserve-api-token"
    args = container(router)["args"]
    assert flag(args, "--tls-cert") == "/etc/splitserve/tls/tls.crt"
    assert flag(args, "--tls-key") == "/etc/splitserve/tls/tls.key"
    assert flag(args, "--token-file") == "/etc/splitserve/auth/token"


def _parse(add, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(args)


def test_cluster_tls_every_ray_pod_issues_its_own_certificate(example_objects):
    """Ray checks a certificate against the address it dials, so each Ray pod's init container
    issues one for its own IP (the head's also for its Service) from the CA Secret; the Ray
    container reads it through --cluster-tls-*, and only the init container sees the CA's key."""
    raycluster = find(example_objects["values-moe-ep"], "RayCluster")
    head = raycluster["spec"]["headGroupSpec"]["template"]
    pods = {"head": head, **{group: worker_group(raycluster, group)["template"] for group in ("prefill", "decode", "router")}}
    for role, pod in pods.items():
        (init,) = pod["spec"]["initContainers"]
        issued = _parse(_add_node_cert, init["args"][1:])
        assert init["command"] == ["splitserve"] and init["args"][0] == "node-cert"
        assert issued.ip == ["$(POD_IP)"]
        assert init["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        expected_dns = ["splitserve-head-svc", "splitserve-head-svc.llm.svc.cluster.local"] if role == "head" else []
        assert issued.dns == expected_dns, role
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        assert str(issued.ca_key).startswith(init_mounts["cluster-ca"] + "/")
        assert str(issued.out) == init_mounts["cluster-tls"]

        ray_container = container(pod)
        args = ray_container["args"]
        add = {"head": _add_up, "router": _add_router}.get(role, _add_worker)
        parsed = _parse(add, args[1:] if role != "head" else [a for a in args[1:] if a not in ("--ray-port", "6379")])
        files = (parsed.cluster_tls_cert, parsed.cluster_tls_key, parsed.cluster_tls_ca)
        assert [f.name for f in files] == ["tls.crt", "tls.key", "ca.crt"] and {f.parent for f in files} == {issued.out}
        mounts = {m["name"]: m for m in ray_container["volumeMounts"]}
        assert mounts["cluster-tls"]["mountPath"] == str(issued.out) and mounts["cluster-tls"]["readOnly"]
        assert "cluster-ca" not in mounts, "the CA's private key stays out of the Ray container"
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["cluster-ca"]["secret"]["secretName"] == "splitserve-cluster-ca"
        assert volumes["cluster-tls"]["emptyDir"] == {"medium": "Memory"}


def test_without_cluster_tls_no_pod_has_an_init_container(example_objects):
    raycluster = find(example_objects["values-cpu-dev"], "RayCluster")
    templates = [raycluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in raycluster["spec"]["workerGroupSpecs"]]
    assert all("initContainers" not in t["spec"] for t in templates)
    assert not any(a.startswith("--cluster-tls") for t in templates for a in container(t)["args"])


def test_engine_weights_and_speculative_decoding_reach_the_head(example_objects):
    head_args = container(find(example_objects["values-cpu-dev"], "RayCluster")["spec"]["headGroupSpec"]["template"])["args"]
    dev = _parse(_add_up, [a for a in head_args[1:] if a not in ("--ray-port", "6379")])
    assert (dev.weights, dev.speculative, dev.num_speculative_tokens) == ("native", "ngram", 4)
    gpu = container(find(example_objects["values-gpu-70b-tp"], "RayCluster")["spec"]["headGroupSpec"]["template"])["args"]
    assert flag(gpu, "--weights") == "native" and "--speculative" not in gpu, "speculation stays off unless asked for"


def test_redis_in_the_release_is_a_statefulset_with_a_claim(example_objects):
    objects = example_objects["values-cpu-dev"]
    redis = find(objects, "StatefulSet", "splitserve-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    find(objects, "Service", "splitserve-redis")
    head = container(find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"])
    assert flag(head["args"], "--redis-url") == "redis://splitserve-redis:6379/0"


@pytest.mark.parametrize("example, shape", [("values-gpu-70b-tp", "tp"), ("values-moe-ep", "ep")])
def test_tensor_and_expert_parallel_examples_turn_both_kv_tiers_on(example_objects, example, shape):
    assert example_values(example)["decode"][shape] > 1  # the multi-rank decode replicas the tiers serve
    objects = example_objects[example]
    head = container(find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"])["args"]
    assert int(flag(head, "--cpu-kv-cache-bytes")) > 0
    assert flag(head, "--redis-url") == "redis://splitserve-redis:6379/0"
    find(objects, "StatefulSet", "splitserve-redis")


def test_external_redis_starts_no_statefulset(example_objects):
    objects = example_objects["values-gpu-llama-8b"]
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    head = container(find(objects, "RayCluster")["spec"]["headGroupSpec"]["template"])
    assert flag(head["args"], "--redis-url") == "redis://kv-cache-redis.llm.svc:6379/0"


def test_router_service_ports(example_objects):
    with_http = find(example_objects["values-cpu-dev"], "Service", "splitserve-router")
    assert {p["name"]: p["port"] for p in with_http["spec"]["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    without_http = find(example_objects["values-gpu-70b-tp"], "Service", "splitserve-router")
    assert {p["name"] for p in without_http["spec"]["ports"]} == {"grpc", "metrics"}
    assert with_http["spec"]["selector"] == {"ray.io/cluster": "splitserve", "ray.io/group": "router"}, "the router pods, not the head"


def test_release_name_names_the_raycluster():
    objects = render_example("values-cpu-dev")
    assert find(objects, "RayCluster")["metadata"]["name"] == "splitserve"
    other = render.render_objects(example_values("values-cpu-dev"), name="prod-a")
    assert find(other, "RayCluster")["metadata"]["name"] == "prod-a"


def test_head_is_ready_when_the_controller_serves_metrics(example_objects):
    head = container(find(example_objects["values-cpu-dev"], "RayCluster")["spec"]["headGroupSpec"]["template"])
    assert head["readinessProbe"]["tcpSocket"] == {"port": "ctrl-metrics"}
    assert {p["name"] for p in head["ports"]} == {"gcs-server", "ctrl-metrics"}


def test_router_is_ready_when_it_serves(example_objects):
    plain = container(worker_group(find(example_objects["values-cpu-dev"], "RayCluster"), "router")["template"])
    assert plain["readinessProbe"]["grpc"] == {"port": 50051}
    with_tls = container(worker_group(find(example_objects["values-moe-ep"], "RayCluster"), "router")["template"])
    assert "grpc" not in with_tls["readinessProbe"], "the kubelet's gRPC probe cannot speak TLS"
    assert with_tls["readinessProbe"]["tcpSocket"] == {"port": "grpc"}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_worker_is_ready_when_its_replica_serves_metrics(pool, example_objects):
    worker = container(worker_group(find(example_objects["values-gpu-llama-8b"], "RayCluster"), pool)["template"])
    assert worker["readinessProbe"]["tcpSocket"] == {"port": "metrics"}
    assert {"name": "metrics", "containerPort": 9402} in worker["ports"]
