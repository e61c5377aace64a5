"""ClusterController: the named actor that owns the cluster map.

It starts and stops worker replicas (by the import path of their actor class, so this module
never imports worker code), checks their health, and answers the routers' and operators'
questions about the pools. It is also where workers exchange KV transport metadata: each decode
replica's endpoint is handed to every prefill replica (``add_kv_peers``) when either joins, so a
hand-off never waits for a connection set-up. Plain asyncio inside; Ray only creates and calls
actors; endpoints pass through as opaque objects.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from dataclasses import dataclass, field

import ray
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from proto import splitserve_pb2 as pb

CONTROLLER_NAME = "splitserve-controller"
NAMESPACE = "splitserve"
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class ControllerConfig:
    """Health checking of worker replicas."""

    health_check_interval_s: float = 2.0
    """Seconds between two status probes of a replica."""
    health_check_timeout_s: float = 10.0
    """A probe that takes longer counts as failed."""
    max_failed_health_checks: int = 3
    """Consecutive failed probes after which a replica is dropped from the map and killed."""
    metrics_host: str = "127.0.0.1"
    """Address of the controller's Prometheus endpoint."""
    metrics_port: int = 0
    """Port of the controller's Prometheus endpoint; 0 picks a free one."""

    def __post_init__(self) -> None:
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_interval_s and health_check_timeout_s: must be > 0")
        if self.max_failed_health_checks < 1:
            raise ValueError(f"max_failed_health_checks: must be >= 1, got {self.max_failed_health_checks}")


@dataclass(frozen=True)
class ReplicaSpec:
    """How to start one worker replica of a pool."""

    pool: str
    """"prefill" or "decode"."""
    actor_class: str
    """``module:Class`` of the worker actor."""
    init_args: tuple
    """Arguments after the replica id, e.g. (EngineConfig, WorkerConfig)."""
    num_cpus: float = 1.0
    """Logical CPUs the actor reserves."""

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool: {self.pool!r} is not one of {POOLS}")
        if ":" not in self.actor_class:
            raise ValueError(f"actor_class: {self.actor_class!r} is not module:Class")


@dataclass
class _Replica:
    handle: object
    model: pb.ModelInfo
    status: pb.ReplicaStatus
    failed_checks: int = 0


@dataclass
class _State:
    replicas: dict[str, _Replica] = field(default_factory=dict)
    routers: dict[str, pb.RouterStatus] = field(default_factory=dict)
    kv_endpoints: dict[str, object] = field(default_factory=dict)
    """Decode replica id -> its KV endpoint (transport metadata included), as the worker published it."""


class _ReplicaCollector(Collector):
    """Replicas per pool and health, read from the cluster map at scrape time."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def collect(self):
        gauge = GaugeMetricFamily("splitserve_replicas", "Worker replicas in the cluster map.", labels=["pool", "healthy"])
        for pool in POOLS:
            for healthy in (True, False):
                count = sum(1 for r in self._state.replicas.values() if r.status.pool == pool and r.status.healthy == healthy)
                gauge.add_metric([pool, str(healthy).lower()], count)
        yield gauge


def pool_resource(pool: str) -> str:
    """The custom Ray resource a node offers per replica slot of ``pool``."""
    return f"splitserve_{pool}"


class ClusterController:
    """Pools, replicas, routers and health. Run as a named async Ray actor."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._state = _State()
        self._ids = {pool: itertools.count() for pool in POOLS}
        self._health_task: asyncio.Task | None = None
        self._introducing = asyncio.Lock()
        registry = CollectorRegistry()
        registry.register(_ReplicaCollector(self._state))
        server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
        self.metrics_url = f"http://{config.metrics_host}:{server.server_port}/metrics"

    async def add_replica(self, spec: ReplicaSpec) -> pb.ReplicaStatus:
        """Start a replica and wait until its model is loaded; returns its first status."""
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._check_health_forever())
        module, _, name = spec.actor_class.partition(":")
        actor_class = ray.remote(getattr(importlib.import_module(module), name))
        replica_id = f"{spec.pool}-{next(self._ids[spec.pool])}"
        handle = actor_class.options(
            name=f"splitserve-{replica_id}",
            namespace=NAMESPACE,
            num_cpus=spec.num_cpus,
            resources={pool_resource(spec.pool): 1},
            max_concurrency=10_000,
            max_restarts=0,
        ).remote(replica_id, *spec.init_args)
        try:
            model = await handle.model_info.remote()
            status = await handle.status.remote()
            async with self._introducing:  # one at a time: each sees every replica introduced before it
                await self._introduce(replica_id, spec.pool, handle)
                self._state.replicas[replica_id] = _Replica(handle, model, status)  # routers may pick it from now on
        except BaseException:
            self._state.kv_endpoints.pop(replica_id, None)
            ray.kill(handle)  # never leave a half-started replica running
            raise
        return status

    async def _introduce(self, replica_id: str, pool: str, handle) -> None:
        """Make a new replica and the other pool's replicas known to each other: prefill workers
        learn the KV endpoints of decode workers (where to write), decode workers learn the
        prefill workers' handles (whom requests submitted on the request plane may name)."""
        if pool == "decode":
            await handle.request_plane.remote()  # starts listening now: a port it cannot bind fails the start, not a request
            prefill = {rid: r.handle for rid, r in self._state.replicas.items() if r.status.pool == "prefill"}
            endpoint = await handle.kv_endpoint.remote()
            if endpoint is None:
                return  # this decode replica takes no remote prefill
            self._state.kv_endpoints[replica_id] = endpoint
            await handle.add_prefill_peers.remote(prefill)
            await asyncio.gather(*(p.add_kv_peers.remote([endpoint]) for p in prefill.values()), return_exceptions=True)
        else:
            await handle.add_kv_peers.remote(list(self._state.kv_endpoints.values()))
            decode = [self._state.replicas[rid].handle for rid in self._state.kv_endpoints if rid in self._state.replicas]
            await asyncio.gather(*(d.add_prefill_peers.remote({replica_id: handle}) for d in decode), return_exceptions=True)

    async def remove_replica(self, replica_id: str) -> bool:
        replica = self._state.replicas.pop(replica_id, None)
        if replica is None:
            return False
        endpoint = self._state.kv_endpoints.pop(replica_id, None)
        if endpoint is not None:
            prefill = [r.handle for r in self._state.replicas.values() if r.status.pool == "prefill"]
            await asyncio.gather(*(p.remove_kv_peer.remote(endpoint.agent_name) for p in prefill), return_exceptions=True)
        if replica.status.pool == "prefill":
            decode = [self._state.replicas[rid].handle for rid in self._state.kv_endpoints if rid in self._state.replicas]
            await asyncio.gather(*(d.remove_prefill_peer.remote(replica_id) for d in decode), return_exceptions=True)
        try:
            await asyncio.wait_for(replica.handle.shutdown.remote(), self.config.health_check_timeout_s)
        except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
            pass  # already gone or stuck; killed below either way
        ray.kill(replica.handle)
        return True

    async def replicas(self) -> list[tuple[pb.ReplicaStatus, pb.ModelInfo, object]]:
        return [(r.status, r.model, r.handle) for r in self._state.replicas.values()]

    async def register_router(self, status: pb.RouterStatus) -> None:
        self._state.routers[status.router_id] = status

    async def unregister_router(self, router_id: str) -> None:
        self._state.routers.pop(router_id, None)

    async def metrics_address(self) -> str:
        return self.metrics_url

    async def cluster_status(self) -> pb.ClusterStatus:
        """Every replica probed now (not the last health check), and the registered routers."""
        await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))
        return pb.ClusterStatus(
            replicas=[r.status for r in self._state.replicas.values()],
            routers=list(self._state.routers.values()),
        )

    async def shutdown(self) -> None:
        """Stop every replica (routers are stopped by whoever started them)."""
        if self._health_task is not None:
            self._health_task.cancel()
        for replica_id in list(self._state.replicas):
            await self.remove_replica(replica_id)

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))

    async def _check(self, replica_id: str) -> None:
        replica = self._state.replicas.get(replica_id)
        if replica is None:
            return
        try:
            status = await asyncio.wait_for(replica.handle.status.remote(), self.config.health_check_timeout_s)
        except (RayActorError, ActorUnavailableError, GetTimeoutError, asyncio.TimeoutError):
            status = None
        if status is not None and status.healthy:
            replica.status, replica.failed_checks = status, 0
            return
        replica.failed_checks += 1
        replica.status.healthy = False
        if replica.failed_checks >= self.config.max_failed_health_checks:
            await self.remove_replica(replica_id)
