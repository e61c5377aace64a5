"""KubeRayConnector: scales the pools by setting ``replicas`` of a KubeRay RayCluster's worker groups.

Each pool is one worker group (``spec.workerGroupSpecs[].groupName``) of one RayCluster; KubeRay
adds or removes the pods and the controller registers the workers as they join.

Where the numbers come from:

- ``target`` is the group's ``replicas`` in the RayCluster spec.
- ``ready``, ``starting`` and ``draining`` come from the group's pods, listed by the labels KubeRay
  puts on them (``ray.io/cluster``, ``ray.io/node-type=worker``, ``ray.io/group``). The RayCluster
  status only has cluster-wide worker counts (``readyWorkerReplicas``, ``availableWorkerReplicas``
  sum every group), which cannot tell prefill from decode. A pod with a ``deletionTimestamp`` is
  draining; a Running pod whose ``Ready`` condition is True is ready; a Pending or not-yet-Ready
  Running pod is starting; Succeeded and Failed pods are not counted (KubeRay replaces them).

How a target is set: a fresh read, then a JSON patch (RFC 6902) that replaces the group's
``replicas`` and also writes back the ``resourceVersion`` that read returned. The API server
compares that resourceVersion with the stored one and answers 409 Conflict when someone wrote in
between (KubeRay itself writes the status often); the connector then reads again and retries, at
most ``max_conflict_retries`` times. (A JSON patch ``test`` op on resourceVersion would not do:
a failed test is 422 Unprocessable Entity, not a retryable 409.)

The target must lie within the group's ``minReplicas``/``maxReplicas``: KubeRay would silently clamp
it, so the connector refuses instead (ConnectorError naming the bounds); the bounds belong to
whoever deployed the RayCluster. For the prefill pool to go to zero its group needs
``minReplicas: 0``.

RBAC: get and patch on ``rayclusters`` (group ``ray.io``) and list on ``pods`` in the namespace.
The ``kubernetes`` client is synchronous, so every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json

import urllib3
from kubernetes import client, config

from planner.connector import POOLS, ConnectorError, PoolReplicas

RAYCLUSTER_GROUP = "ray.io"
RAYCLUSTER_VERSION = "v1"
RAYCLUSTER_PLURAL = "rayclusters"
RAYCLUSTER_RESOURCE = f"{RAYCLUSTER_PLURAL}.{RAYCLUSTER_GROUP}"
JSON_PATCH = "application/json-patch+json"
DEFAULT_GROUP_NAMES = {"prefill": "prefill", "decode": "decode"}


class KubeRayConnector:
    """Connector for one KubeRay RayCluster whose worker groups are the prefill and decode pools.

    ``pools`` maps each pool to its worker group's ``groupName``. Without ``api_client`` the
    in-cluster service account is used, or else the local kubeconfig.
    """

    def __init__(
        self,
        namespace: str,
        raycluster_name: str,
        api_client: client.ApiClient | None = None,
        pools: dict[str, str] | None = None,
        max_conflict_retries: int = 5,
    ) -> None:
        group_names = dict(DEFAULT_GROUP_NAMES if pools is None else pools)
        unknown = sorted(set(group_names) - set(POOLS))
        if unknown:
            raise ValueError(f"pools must be among {POOLS}, got {unknown}")
        if max_conflict_retries < 0:
            raise ValueError(f"max_conflict_retries must be >= 0, got {max_conflict_retries}")
        self.namespace = namespace
        self.raycluster_name = raycluster_name
        self.group_names = group_names
        self.max_conflict_retries = max_conflict_retries
        api_client = api_client if api_client is not None else _api_client_from_environment()
        self._custom_objects = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    async def pools(self) -> dict[str, PoolReplicas]:
        """Every configured pool's target (spec) and its pods' states."""
        return await asyncio.to_thread(self._read_pools)

    async def set_replicas(self, pool: str, target: int) -> None:
        """Set the pool's worker group to ``target`` replicas; no write when it is already there.
        Raises ConnectorError when the group is missing, ``target`` is outside the group's
        min/max, the API refuses, or conflicts outlast ``max_conflict_retries``."""
        if target < 0:
            raise ValueError(f"target must be >= 0, got {target}")
        await asyncio.to_thread(self._set_replicas, pool, target)

    def _read_pools(self) -> dict[str, PoolReplicas]:
        raycluster = self._get_raycluster()
        selector = f"ray.io/cluster={self.raycluster_name},ray.io/node-type=worker"
        pods = self._call("list", "pods", "", lambda: self._core.list_namespaced_pod(
            self.namespace, label_selector=selector).items)
        found = {}
        for pool, group_name in self.group_names.items():
            _, group = self._find_group(raycluster, pool)
            states = [_pod_state(p) for p in pods if (p.metadata.labels or {}).get("ray.io/group") == group_name]
            found[pool] = PoolReplicas(
                pool=pool,
                target=int(group.get("replicas", 0)),
                ready=states.count("ready"),
                starting=states.count("starting"),
                draining=states.count("draining"),
            )
        return found

    def _set_replicas(self, pool: str, target: int) -> None:
        for _ in range(self.max_conflict_retries + 1):
            raycluster = self._get_raycluster()
            index, group = self._find_group(raycluster, pool)
            self._check_bounds(pool, group, target)
            if group.get("replicas") == target:
                return
            patch = [
                {"op": "replace", "path": "/metadata/resourceVersion",
                 "value": raycluster["metadata"]["resourceVersion"]},
                {"op": "replace" if "replicas" in group else "add",
                 "path": f"/spec/workerGroupSpecs/{index}/replicas", "value": target},
            ]
            try:
                self._call("patch", RAYCLUSTER_RESOURCE, self.raycluster_name, lambda: (
                    self._custom_objects.patch_namespaced_custom_object(
                        RAYCLUSTER_GROUP, RAYCLUSTER_VERSION, self.namespace, RAYCLUSTER_PLURAL,
                        self.raycluster_name, patch, _content_type=JSON_PATCH)))
                return
            except _Conflict:
                continue
        raise ConnectorError(
            f'could not set pool "{pool}" to {target} replicas: RayCluster {self._where()} changed '
            f"under every one of {self.max_conflict_retries + 1} attempts (409 Conflict each time)")

    def _get_raycluster(self) -> dict:
        return self._call("get", RAYCLUSTER_RESOURCE, self.raycluster_name, lambda: (
            self._custom_objects.get_namespaced_custom_object(
                RAYCLUSTER_GROUP, RAYCLUSTER_VERSION, self.namespace, RAYCLUSTER_PLURAL,
                self.raycluster_name)))

    def _find_group(self, raycluster: dict, pool: str) -> tuple[int, dict]:
        if pool not in self.group_names:
            raise ConnectorError(f'no worker group is configured for pool "{pool}" '
                                 f"(configured: {sorted(self.group_names)})")
        group_name = self.group_names[pool]
        groups = raycluster.get("spec", {}).get("workerGroupSpecs") or []
        for index, group in enumerate(groups):
            if group.get("groupName") == group_name:
                return index, group
        present = ", ".join(f'"{g.get("groupName")}"' for g in groups) or "none"
        raise ConnectorError(
            f'RayCluster {self._where()} has no worker group "{group_name}" for pool "{pool}" '
            f"(its worker groups: {present})")

    def _check_bounds(self, pool: str, group: dict, target: int) -> None:
        min_replicas = int(group.get("minReplicas", 0))
        max_replicas = group.get("maxReplicas")
        if target < min_replicas or (max_replicas is not None and target > int(max_replicas)):
            raise ConnectorError(
                f'cannot set pool "{pool}" to {target} replicas: worker group '
                f'"{group["groupName"]}" of RayCluster {self._where()} allows '
                f"minReplicas={min_replicas} to maxReplicas={max_replicas}; change the group's "
                "bounds or the planner's limits for this pool")

    def _call(self, verb: str, resource: str, name: str, request):
        try:
            return request()
        except client.ApiException as e:
            if e.status == 409:
                raise _Conflict() from e
            raise ConnectorError(self._describe_refusal(e, verb, resource, name)) from e
        except urllib3.exceptions.HTTPError as e:
            raise ConnectorError(
                f"could not reach the Kubernetes API to {verb} {resource} in namespace "
                f'"{self.namespace}": {e}') from e

    def _describe_refusal(self, e: client.ApiException, verb: str, resource: str, name: str) -> str:
        target = f'{resource} "{name}"' if name else resource
        message = _status_message(e)
        if e.status == 403:
            return (
                f'Kubernetes refused to {verb} {target} in namespace "{self.namespace}" '
                f"(403 Forbidden: {message}); the planner's RBAC must allow get and patch on "
                f"{RAYCLUSTER_RESOURCE} and list on pods in that namespace")
        if e.status == 404 and resource == RAYCLUSTER_RESOURCE:
            return f"RayCluster {self._where()} was not found (404 Not Found: {message})"
        return (f'Kubernetes answered {e.status} {e.reason} to {verb} {target} in namespace '
                f'"{self.namespace}": {message}')

    def _where(self) -> str:
        return f'"{self.raycluster_name}" in namespace "{self.namespace}"'


class _Conflict(Exception):
    """A write raced another writer (409); read again and retry."""


def _pod_state(pod: client.V1Pod) -> str:
    if pod.metadata.deletion_timestamp is not None:
        return "draining"
    phase = pod.status.phase if pod.status else None
    if phase == "Running" and any(
            c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or [])):
        return "ready"
    if phase in ("Pending", "Running"):
        return "starting"
    return "gone"


def _status_message(e: client.ApiException) -> str:
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return e.body or ""


def _api_client_from_environment() -> client.ApiClient:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except config.ConfigException as e:
            raise ConnectorError(
                "no Kubernetes credentials: not running in a pod with a service account, "
                f"and no usable kubeconfig ({e})") from e
    return client.ApiClient(configuration)
