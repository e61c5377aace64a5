"""KubeRayConnector against FakeKubeAPIServer, through the real ``kubernetes`` client over HTTP."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from planner.connector import ConnectorError, PoolReplicas
from planner.connectors import connector_class
from planner.connectors.kubernetes import KubeRayConnector
from tests.fake_kube import FakeKubeAPIServer

NAMESPACE = "serving"
NAME = "splitserve"
RAYCLUSTER_PATH = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayclusters/{NAME}"


def _worker_group(group_name: str, replicas: int, min_replicas: int, max_replicas: int) -> dict:
    return {
        "groupName": group_name,
        "replicas": replicas,
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "rayStartParams": {"resources": f'"{{\\"{group_name}\\": 1}}"'},
        "template": {"spec": {"containers": [{
            "name": "ray-worker",
            "image": "splitserve:test",
            "args": ["splitserve", "worker", "--pool", group_name],
        }]}},
    }


def _raycluster() -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "0c5e-rc"},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
                {"name": "ray-head", "image": "splitserve:test"}]}}},
            "workerGroupSpecs": [_worker_group("prefill", 1, 0, 4), _worker_group("decode", 2, 1, 8)],
        },
        "status": {"state": "ready", "readyWorkerReplicas": 3, "availableWorkerReplicas": 3,
                   "desiredWorkerReplicas": 3},
    }


def _pod(name: str, group: str | None, phase: str, ready: bool, deleting: bool = False,
         cluster: str = NAME) -> dict:
    labels = {"ray.io/cluster": cluster, "ray.io/node-type": "worker" if group else "head"}
    if group:
        labels["ray.io/group"] = group
    metadata = {"name": name, "namespace": NAMESPACE, "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "status": {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture
def fake():
    with FakeKubeAPIServer() as server:
        server.add_raycluster(_raycluster())
        for pod in (
            _pod("splitserve-head", None, "Running", True),
            _pod("splitserve-prefill-a", "prefill", "Running", True),
            _pod("splitserve-prefill-old", "prefill", "Failed", False),
            _pod("splitserve-decode-a", "decode", "Running", True),
            _pod("splitserve-decode-b", "decode", "Running", False),
            _pod("splitserve-decode-c", "decode", "Pending", False),
            _pod("splitserve-decode-d", "decode", "Running", True, deleting=True),
            _pod("other-decode-a", "decode", "Running", True, cluster="other"),
        ):
            server.add_pod(pod)
        yield server


@pytest.fixture
def api_client(fake):
    configuration = client.Configuration(host=fake.url)
    configuration.retries = 0
    with client.ApiClient(configuration) as api:
        yield api


def _connector(api_client, **kwargs) -> KubeRayConnector:
    return KubeRayConnector(NAMESPACE, NAME, api_client=api_client, **kwargs)


def _replicas(raycluster: dict) -> dict[str, int]:
    return {g["groupName"]: g["replicas"] for g in raycluster["spec"]["workerGroupSpecs"]}


def test_pools_report_each_groups_target_and_its_own_pods(fake, api_client):
    pools = asyncio.run(_connector(api_client).pools())

    assert pools == {
        "prefill": PoolReplicas("prefill", target=1, ready=1, starting=0, draining=0),
        "decode": PoolReplicas("decode", target=2, ready=1, starting=2, draining=1),
    }
    assert fake.verbs() == [("get", 200), ("list", 200)]


def test_set_replicas_patches_only_the_named_group(fake, api_client):
    before = fake.raycluster(NAMESPACE, NAME)

    asyncio.run(_connector(api_client).set_replicas("decode", 3))

    after = fake.raycluster(NAMESPACE, NAME)
    assert _replicas(after) == {"prefill": 1, "decode": 3}
    before["spec"]["workerGroupSpecs"][1]["replicas"] = 3
    assert after["spec"] == before["spec"]
    assert after["status"] == before["status"]
    assert int(after["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert fake.verbs() == [("get", 200), ("patch", 200)]
    assert fake.requests[1].path == RAYCLUSTER_PATH
    assert fake.requests[1].content_type == "application/json-patch+json"


def test_set_replicas_to_the_current_target_writes_nothing(fake, api_client):
    asyncio.run(_connector(api_client).set_replicas("prefill", 1))

    assert fake.verbs() == [("get", 200)]


def test_a_conflict_is_retried_on_a_fresh_read_and_keeps_the_other_writers_change(fake, api_client):
    def other_writer(raycluster: dict) -> None:
        raycluster["spec"]["workerGroupSpecs"][0]["replicas"] = 2
        raycluster["metadata"].setdefault("annotations", {})["other-writer"] = "was-here"

    fake.concurrent_writes(1, other_writer)

    asyncio.run(_connector(api_client).set_replicas("decode", 3))

    after = fake.raycluster(NAMESPACE, NAME)
    assert _replicas(after) == {"prefill": 2, "decode": 3}
    assert after["metadata"]["annotations"] == {"other-writer": "was-here"}
    assert fake.verbs() == [("get", 200), ("patch", 409), ("get", 200), ("patch", 200)]


def test_conflicts_past_the_retry_budget_raise_and_write_nothing_of_ours(fake, api_client):
    def other_writer(raycluster: dict) -> None:
        raycluster["spec"]["workerGroupSpecs"][0]["replicas"] += 1

    fake.concurrent_writes(3, other_writer)

    with pytest.raises(ConnectorError) as refused:
        asyncio.run(_connector(api_client, max_conflict_retries=2).set_replicas("decode", 3))

    assert str(refused.value) == (
        'could not set pool "decode" to 3 replicas: RayCluster "splitserve" in namespace "serving" '
        "changed under every one of 3 attempts (409 Conflict each time)")
    assert _replicas(fake.raycluster(NAMESPACE, NAME)) == {"prefill": 4, "decode": 2}
    assert fake.verbs() == [("get", 200), ("patch", 409)] * 3


def test_a_forbidden_patch_names_the_verb_resource_namespace_and_the_rbac_it_needs(fake, api_client):
    fake.refuse("patch", 403)

    with pytest.raises(ConnectorError) as refused:
        asyncio.run(_connector(api_client).set_replicas("prefill", 2))

    assert str(refused.value) == (
        'Kubernetes refused to patch rayclusters.ray.io "splitserve" in namespace "serving" '
        '(403 Forbidden: rayclusters.ray.io "splitserve" is forbidden: User '
        '"system:serviceaccount:serving:splitserve-planner" cannot patch resource "rayclusters" '
        'in API group "ray.io" in the namespace "serving"); the planner\'s RBAC must allow get '
        "and patch on rayclusters.ray.io and list on pods in that namespace")
    assert fake.verbs() == [("get", 200), ("patch", 403)]
    assert _replicas(fake.raycluster(NAMESPACE, NAME)) == {"prefill": 1, "decode": 2}


def test_a_forbidden_pod_list_is_reported_the_same_way(fake, api_client):
    fake.refuse("list", 403)

    with pytest.raises(ConnectorError, match=r"^Kubernetes refused to list pods in namespace "
                                             r'"serving" \(403 Forbidden: pods is forbidden: '):
        asyncio.run(_connector(api_client).pools())


def test_a_missing_worker_group_is_named_with_the_groups_that_exist(fake, api_client):
    connector = _connector(api_client, pools={"prefill": "prefill", "decode": "decode-gpu"})
    expected = ('RayCluster "splitserve" in namespace "serving" has no worker group "decode-gpu" '
                'for pool "decode" (its worker groups: "prefill", "decode")')

    with pytest.raises(ConnectorError) as from_pools:
        asyncio.run(connector.pools())
    with pytest.raises(ConnectorError) as from_set:
        asyncio.run(connector.set_replicas("decode", 3))

    assert str(from_pools.value) == expected
    assert str(from_set.value) == expected
    assert [verb for verb, _ in fake.verbs()] == ["get", "list", "get"]


def test_a_pool_without_a_group_is_refused(fake, api_client):
    connector = _connector(api_client, pools={"decode": "decode"})

    assert list(asyncio.run(connector.pools())) == ["decode"]
    with pytest.raises(ConnectorError, match=r'^no worker group is configured for pool "prefill"'):
        asyncio.run(connector.set_replicas("prefill", 1))


@pytest.mark.parametrize(("pool", "target", "bounds"), [
    ("decode", 9, "minReplicas=1 to maxReplicas=8"),
    ("decode", 0, "minReplicas=1 to maxReplicas=8"),
    ("prefill", 5, "minReplicas=0 to maxReplicas=4"),
])
def test_a_target_outside_the_groups_bounds_is_refused_before_any_write(fake, api_client, pool, target, bounds):
    with pytest.raises(ConnectorError) as refused:
        asyncio.run(_connector(api_client).set_replicas(pool, target))

    assert str(refused.value) == (
        f'cannot set pool "{pool}" to {target} replicas: worker group "{pool}" of RayCluster '
        f'"splitserve" in namespace "serving" allows {bounds}; change the group\'s bounds or the '
        "planner's limits for this pool")
    assert fake.verbs() == [("get", 200)]


def test_the_bounds_themselves_are_allowed_and_prefill_may_go_to_zero(fake, api_client):
    connector = _connector(api_client)

    asyncio.run(connector.set_replicas("prefill", 0))
    asyncio.run(connector.set_replicas("decode", 8))

    assert _replicas(fake.raycluster(NAMESPACE, NAME)) == {"prefill": 0, "decode": 8}


def test_a_missing_raycluster_is_named(fake, api_client):
    connector = KubeRayConnector(NAMESPACE, "gone", api_client=api_client)

    with pytest.raises(ConnectorError) as refused:
        asyncio.run(connector.pools())

    assert str(refused.value) == ('RayCluster "gone" in namespace "serving" was not found '
                                  '(404 Not Found: rayclusters.ray.io "gone" not found)')


def test_other_api_errors_carry_status_and_reason(fake, api_client):
    fake.refuse("get", 500)

    with pytest.raises(ConnectorError) as refused:
        asyncio.run(_connector(api_client).set_replicas("decode", 3))

    assert str(refused.value) == ('Kubernetes answered 500 Internal Server Error to get '
                                  'rayclusters.ray.io "splitserve" in namespace "serving": '
                                  "the fake was told to answer get with 500")


def test_an_unreachable_api_server_is_a_connector_error():
    with FakeKubeAPIServer() as stopped:
        url = stopped.url
    configuration = client.Configuration(host=url)
    configuration.retries = 0
    with client.ApiClient(configuration) as api:
        with pytest.raises(ConnectorError, match=r"^could not reach the Kubernetes API to get "
                                                 r'rayclusters.ray.io in namespace "serving": '):
            asyncio.run(KubeRayConnector(NAMESPACE, NAME, api_client=api).pools())


def test_calls_run_off_the_event_loop(fake, api_client):
    connector = _connector(api_client)

    async def scenario() -> dict[str, PoolReplicas]:
        with fake.hold_requests() as hold:
            task = asyncio.create_task(connector.pools())
            # This coroutine resumes while the connector's request is still held in the server:
            # a client call made on the loop thread would hold the loop until the hold times out.
            assert await asyncio.to_thread(hold.arrived.wait, 10.0)
            assert not task.done()
            hold.release.set()
        return await task

    pools = asyncio.run(scenario())

    assert pools["decode"].target == 2


def test_the_connector_is_registered_by_name():
    assert connector_class("kubernetes") is KubeRayConnector
    with pytest.raises(ValueError, match="unknown connector 'k8s'"):
        connector_class("k8s")


def test_unknown_pool_names_and_negative_targets_are_caller_errors(api_client):
    with pytest.raises(ValueError, match=r"pools must be among \('prefill', 'decode'\), got \['gpu'\]"):
        KubeRayConnector(NAMESPACE, NAME, api_client=api_client, pools={"gpu": "gpu"})
    with pytest.raises(ValueError, match="target must be >= 0, got -1"):
        asyncio.run(_connector(api_client).set_replicas("decode", -1))


def test_the_fake_holds_every_write_type_to_the_stored_resource_version(fake, api_client):
    api = client.CustomObjectsApi(api_client)
    args = ("ray.io", "v1", NAMESPACE, "rayclusters", NAME)
    stale = api.get_namespaced_custom_object(*args)
    api.patch_namespaced_custom_object(*args, {"metadata": {"labels": {"team": "serving"}}})

    def code_of(write) -> int:
        with pytest.raises(client.ApiException) as refused:
            write()
        return refused.value.status

    assert code_of(lambda: api.replace_namespaced_custom_object(*args, stale)) == 409
    assert code_of(lambda: api.patch_namespaced_custom_object(
        *args, {"metadata": {"resourceVersion": stale["metadata"]["resourceVersion"]}})) == 409
    assert code_of(lambda: api.patch_namespaced_custom_object(
        *args, [{"op": "test", "path": "/spec/workerGroupSpecs/0/groupName", "value": "decode"}],
        _content_type="application/json-patch+json")) == 422
    assert code_of(lambda: api.patch_namespaced_custom_object(
        *args, {"spec": {}}, _content_type="application/strategic-merge-patch+json")) == 415
    assert fake.raycluster(NAMESPACE, NAME)["metadata"]["labels"] == {"team": "serving"}
    # The 37.x client sends a PUT without a Content-Type; the apiserver then assumes JSON.
    assert [r.content_type for r in fake.requests[1:3]] == ["application/merge-patch+json", ""]
