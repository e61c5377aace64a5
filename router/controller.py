"""ClusterController: the named actor that owns the cluster map.

It starts and stops worker replicas (by the import path of their actor class, so this module
never imports worker code), checks their health, keeps each pool at its target size, and answers
the routers' and operators' questions about the pools.

Self-healing: every health round probes each replica. An actor that is gone (killed, crashed, its
node lost) is dropped at its first failed probe, one that stops answering after
``max_failed_health_checks``; either way it is released (prefill workers forget its KV endpoint,
decode workers its handle; routers drop it, and its prefix-index entries, at their next refresh)
and killed. Then a replacement is started with the pool's spec, at once for a replica that had run
``stable_after_s``, after an exponential backoff while replacements keep dying young or failing
to start::

    probe fails ──> drop + release + kill ──> pool below target ──> start replacement
                                                   ^                    | fails, or dies young
                                                   └──── backoff x2 ────┘  (restart_backoff_s .. max)

It is also where workers exchange KV transport metadata: each decode replica's endpoint is handed
to every prefill replica (``add_kv_peers``) when either joins, so a hand-off never waits for a
connection set-up. Plain asyncio inside; Ray only creates and calls
actors; endpoints pass through as opaque objects.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import ray
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from proto import splitserve_pb2 as pb
from router import placement

logger = logging.getLogger(__name__)

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
    restart_backoff_s: float = 1.0
    """Delay before the next replacement once one failed to start or died young; doubles each time."""
    max_restart_backoff_s: float = 60.0
    """Longest delay between replacements."""
    stable_after_s: float = 30.0
    """A replica that ran this long counts as healthy: its death is replaced at once, with no backoff."""

    def __post_init__(self) -> None:
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_interval_s and health_check_timeout_s: must be > 0")
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValueError(f"restart_backoff_s: must be > 0 and <= max_restart_backoff_s, got {self.restart_backoff_s} / {self.max_restart_backoff_s}")
        if self.stable_after_s < 0:
            raise ValueError(f"stable_after_s: must be >= 0, got {self.stable_after_s}")
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
    tp_size: int = 1
    """Processes of each replica (its tensor- or expert-parallel ranks): above 1, the replica is
    placed as a placement group of that many bundles on one node (router/placement.py)."""
    rank_kind: str = "TP"
    """What the ranks split, for messages: "TP" (the model) or "EP" (its experts)."""
    tp_rank_cpus: float = 1.0
    """Logical CPUs each follower rank reserves."""
    tp_rank_gpus: float = 0.0
    """GPUs each rank reserves (the leader too); 0 on CPU."""
    placement_timeout_s: float = 120.0
    """How long a replica's placement group may wait for resources before its start fails."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.pool not in POOLS:
            raise ValueError(f"pool: {self.pool!r} is not one of {POOLS}")
        if ":" not in self.actor_class:
            raise ValueError(f"actor_class: {self.actor_class!r} is not module:Class")


@dataclass
class _Replica:
    handle: object
    model: pb.ModelInfo
    status: pb.ReplicaStatus
    started_s: float
    """``time.monotonic`` when it joined the map."""
    failed_checks: int = 0
    placement_group: object = None
    """The placement group of a tensor-parallel replica's ranks; removed with the replica."""
    draining: bool = False
    """Being removed: it takes no new request (routers see ``status.draining``) and is removed when idle."""


@dataclass
class _Pool:
    """What the controller keeps a pool at, and its history of replacements."""

    spec: ReplicaSpec | None = None
    """How its replicas start; None until the first replica of the pool is asked for."""
    target: int = 0
    num_starting: int = 0
    num_restarts: int = 0
    num_failed_starts: int = 0
    num_young_failures: int = 0
    """Replacements in a row that failed to start or died before ``stable_after_s``."""
    next_start_s: float = 0.0
    """``time.monotonic`` before which no replacement starts (the backoff)."""
    last_failure: str = ""


@dataclass
class _State:
    replicas: dict[str, _Replica] = field(default_factory=dict)
    pools: dict[str, _Pool] = field(default_factory=lambda: {pool: _Pool() for pool in POOLS})
    routers: dict[str, pb.RouterStatus] = field(default_factory=dict)
    kv_endpoints: dict[str, tuple] = field(default_factory=dict)
    """Decode replica id -> its ranks' KV endpoints (transport metadata included), as the worker published them."""

    def members(self, pool: str) -> list[str]:
        """Ids of the replicas of ``pool`` in the map, oldest first."""
        return [rid for rid, r in self.replicas.items() if r.status.pool == pool]


class _ReplicaCollector(Collector):
    """Replicas per pool and health, read from the cluster map at scrape time."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def collect(self):
        gauge = GaugeMetricFamily("splitserve_replicas", "Worker replicas in the cluster map.", labels=["pool", "healthy"])
        target = GaugeMetricFamily("splitserve_pool_target_replicas", "Replicas the controller keeps each pool at.", labels=["pool"])
        starting = GaugeMetricFamily("splitserve_pool_starting_replicas", "Replacements being started.", labels=["pool"])
        restarts = CounterMetricFamily("splitserve_replica_restarts", "Replacements started for replicas that died.", labels=["pool"])
        failed = CounterMetricFamily("splitserve_replica_failed_starts", "Replacements that failed to start.", labels=["pool"])
        for pool in POOLS:
            for healthy in (True, False):
                count = sum(1 for r in self._state.replicas.values() if r.status.pool == pool and r.status.healthy == healthy)
                gauge.add_metric([pool, str(healthy).lower()], count)
            state = self._state.pools[pool]
            target.add_metric([pool], state.target)
            starting.add_metric([pool], state.num_starting)
            restarts.add_metric([pool], state.num_restarts)
            failed.add_metric([pool], state.num_failed_starts)
        yield from (gauge, target, starting, restarts, failed)


def _reason(error: Exception) -> str:
    """One line saying why a call into a replica failed (the worker's own exception for a task error)."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


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
        self._replacements: set[asyncio.Task] = set()
        self._introducing = asyncio.Lock()
        registry = CollectorRegistry()
        registry.register(_ReplicaCollector(self._state))
        server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
        self.metrics_url = f"http://{config.metrics_host}:{server.server_port}/metrics"

    async def set_pool(self, spec: ReplicaSpec, num_replicas: int) -> list[pb.ReplicaStatus]:
        """Keep ``spec.pool`` at ``num_replicas`` replicas started from ``spec``: start the missing
        ones now (all at once; raises if one fails, after stopping it) or remove the newest surplus
        ones. Returns the statuses of the replicas started."""
        if num_replicas < 0:
            raise ValueError(f"num_replicas: must be >= 0, got {num_replicas}")
        pool = self._state.pools[spec.pool]
        pool.spec, pool.target = spec, num_replicas
        members = self._state.members(spec.pool)
        for replica_id in members[num_replicas:][::-1]:
            await self._remove(replica_id)
        return await self._start_missing(pool, spec, num_replicas - len(members) - pool.num_starting)

    async def add_replica(self, spec: ReplicaSpec) -> pb.ReplicaStatus:
        """Grow ``spec.pool`` by one replica started from ``spec``; returns its first status.
        A replica that fails to start is stopped, and the pool's target is left as it was."""
        started = await self._start(spec)
        pool = self._state.pools[spec.pool]
        pool.spec, pool.target = spec, pool.target + 1
        return started

    async def scale_pool(self, pool_name: str, target: int, drain_timeout_s: float = 300.0) -> None:
        """Set a pool's size (the planner's action): start the replicas it lacks now, and drain
        the newest surplus ones: they take no new request, finish the ones they have (or are
        removed after ``drain_timeout_s``), then leave the map, which tells routers that their
        cached prefixes are gone. A drain that brings the pool below ``target`` again is cancelled
        by un-draining the replica instead of starting a new one. Raises for an unknown pool, a
        pool never started, or a replica that fails to start."""
        if pool_name not in POOLS:
            raise ValueError(f"pool: {pool_name!r} is not one of {POOLS}")
        if target < 0:
            raise ValueError(f"target: must be >= 0, got {target}")
        pool = self._state.pools[pool_name]
        if pool.spec is None:
            raise ValueError(f"pool {pool_name!r} was never started: no spec to start replicas from")
        pool.target = target
        active = [rid for rid in self._state.members(pool_name) if not self._state.replicas[rid].draining]
        draining = [rid for rid in self._state.members(pool_name) if self._state.replicas[rid].draining]
        for replica_id in draining[::-1][: max(0, target - len(active))]:  # take back the newest drains first
            self._set_draining(replica_id, False)
            active.append(replica_id)
        for replica_id in active[target:][::-1]:
            self._set_draining(replica_id, True)
            task = asyncio.get_running_loop().create_task(self._drain(replica_id, drain_timeout_s))
            self._replacements.add(task)
            task.add_done_callback(self._replacements.discard)
        await self._start_missing(pool, pool.spec, target - len(active) - pool.num_starting)

    async def _start_missing(self, pool: _Pool, spec: ReplicaSpec, missing: int) -> list[pb.ReplicaStatus]:
        """Start ``missing`` replicas at once (none when it is 0 or less); their statuses. If one
        fails, the pool stays short: the failure is counted and replacements follow after the backoff."""
        try:
            return list(await asyncio.gather(*(self._start(spec) for _ in range(missing))))
        except Exception as e:
            self._failed_start(pool, e)
            raise

    def _set_draining(self, replica_id: str, draining: bool) -> None:
        replica = self._state.replicas[replica_id]
        replica.draining = replica.status.draining = draining

    async def _drain(self, replica_id: str, timeout_s: float) -> None:
        """Remove ``replica_id`` once it holds no request (or after ``timeout_s``), unless un-drained meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            replica = self._state.replicas.get(replica_id)
            if replica is None or not replica.draining:
                return
            try:
                status = await asyncio.wait_for(replica.handle.status.remote(), self.config.health_check_timeout_s)
            except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
                break  # gone or stuck: nothing left to wait for
            if status.num_running + status.num_waiting == 0:
                break
            await asyncio.sleep(0.5)
        replica = self._state.replicas.get(replica_id)
        if replica is not None and replica.draining:
            await self._remove(replica_id)

    async def remove_replica(self, replica_id: str) -> bool:
        """Stop a replica for good: its pool's target shrinks by one (it is not replaced)."""
        replica = self._state.replicas.get(replica_id)
        if replica is None:
            return False
        pool = self._state.pools[replica.status.pool]
        pool.target = max(0, pool.target - 1)
        return await self._remove(replica_id)

    async def _start(self, spec: ReplicaSpec) -> pb.ReplicaStatus:
        """Start a replica and wait until its model is loaded and it is introduced to the others."""
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._check_health_forever())
        module, _, name = spec.actor_class.partition(":")
        actor_class = ray.remote(getattr(importlib.import_module(module), name))
        replica_id = f"{spec.pool}-{next(self._ids[spec.pool])}"
        pool = self._state.pools[spec.pool]
        pool.num_starting += 1
        group = handle = None
        try:
            options = dict(num_cpus=spec.num_cpus, resources={pool_resource(spec.pool): 1})
            if spec.tp_size > 1:
                wanted = placement.bundles(spec.tp_size, spec.num_cpus, spec.tp_rank_cpus, pool_resource(spec.pool), spec.tp_rank_gpus)
                group = await placement.reserve(f"a {spec.rank_kind} {spec.tp_size} {spec.pool} replica", wanted, spec.placement_timeout_s)
                strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
                options.update(scheduling_strategy=strategy, num_gpus=spec.tp_rank_gpus)
            handle = actor_class.options(
                name=f"splitserve-{replica_id}", namespace=NAMESPACE, max_concurrency=10_000, max_restarts=0, **options
            ).remote(replica_id, *spec.init_args)
            model = await handle.model_info.remote()
            status = await handle.status.remote()
            async with self._introducing:  # one at a time: each sees every replica introduced before it
                await self._introduce(replica_id, spec.pool, handle)
                self._state.replicas[replica_id] = _Replica(handle, model, status, time.monotonic(), placement_group=group)  # routers may pick it from now on
        except BaseException:
            self._state.kv_endpoints.pop(replica_id, None)
            if handle is not None:
                ray.kill(handle)  # never leave a half-started replica running
            placement.release(group)
            raise
        finally:
            pool.num_starting -= 1
        return status

    async def _introduce(self, replica_id: str, pool: str, handle) -> None:
        """Make a new replica and the other pool's replicas known to each other: prefill workers
        learn the KV endpoints of decode workers (where to write), decode workers learn the
        prefill workers' handles (whom requests submitted on the request plane may name)."""
        if pool == "decode":
            await handle.request_plane.remote()  # starts listening now: a port it cannot bind fails the start, not a request
            prefill = {rid: r.handle for rid, r in self._state.replicas.items() if r.status.pool == "prefill"}
            endpoints = await handle.kv_endpoints.remote()
            if not endpoints:
                return  # this decode replica takes no remote prefill
            self._state.kv_endpoints[replica_id] = endpoints
            await handle.add_prefill_peers.remote(prefill)
            await asyncio.gather(*(p.add_kv_peers.remote(list(endpoints)) for p in prefill.values()), return_exceptions=True)
        else:
            await handle.add_kv_peers.remote([e for endpoints in self._state.kv_endpoints.values() for e in endpoints])
            decode = [self._state.replicas[rid].handle for rid in self._state.kv_endpoints if rid in self._state.replicas]
            await asyncio.gather(*(d.add_prefill_peers.remote({replica_id: handle}) for d in decode), return_exceptions=True)

    async def _remove(self, replica_id: str) -> bool:
        """Take a replica out of the map, release what the others hold for it, stop it."""
        replica = self._state.replicas.pop(replica_id, None)
        if replica is None:
            return False
        endpoints = self._state.kv_endpoints.pop(replica_id, None)
        if endpoints:
            prefill = [r.handle for r in self._state.replicas.values() if r.status.pool == "prefill"]
            names = [e.agent_name for e in endpoints]
            await asyncio.gather(*(p.remove_kv_peers.remote(names) for p in prefill), return_exceptions=True)
        if replica.status.pool == "prefill":
            decode = [self._state.replicas[rid].handle for rid in self._state.kv_endpoints if rid in self._state.replicas]
            await asyncio.gather(*(d.remove_prefill_peer.remote(replica_id) for d in decode), return_exceptions=True)
        try:
            await asyncio.wait_for(replica.handle.shutdown.remote(), self.config.health_check_timeout_s)
        except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
            pass  # already gone or stuck; killed below either way
        ray.kill(replica.handle)  # its follower ranks die with it (it owns them)
        placement.release(replica.placement_group)
        return True

    async def _replica_died(self, replica_id: str, reason: str) -> None:
        """Drop a dead or unresponsive replica; its pool gets a replacement (``_heal``)."""
        replica = self._state.replicas.get(replica_id)
        if replica is None:
            return
        pool = self._state.pools[replica.status.pool]
        lived_s = time.monotonic() - replica.started_s
        logger.warning("controller: replica %s died after %.1f s (%s); replacing it", replica_id, lived_s, reason)
        pool.last_failure = f"{replica_id}: {reason}"
        if lived_s < self.config.stable_after_s:
            self._back_off(pool)
        else:
            pool.num_young_failures, pool.next_start_s = 0, 0.0
        await self._remove(replica_id)
        self._heal()

    def _failed_start(self, pool: _Pool, error: Exception) -> None:
        pool.num_failed_starts += 1
        pool.last_failure = f"start failed: {_reason(error)}"
        self._back_off(pool)
        logger.warning("controller: a replica of pool %s failed to start (%s); next try in %.1f s",
                       pool.spec.pool, pool.last_failure, pool.next_start_s - time.monotonic())

    def _back_off(self, pool: _Pool) -> None:
        pool.num_young_failures += 1
        delay = min(self.config.max_restart_backoff_s, self.config.restart_backoff_s * 2 ** (pool.num_young_failures - 1))
        pool.next_start_s = time.monotonic() + delay

    def _heal(self) -> None:
        """Start a replacement for every replica a pool lacks, unless its backoff runs."""
        now = time.monotonic()
        for name, pool in self._state.pools.items():
            if pool.spec is None or now < pool.next_start_s:
                continue
            for _ in range(pool.target - len(self._state.members(name)) - pool.num_starting):
                task = asyncio.get_running_loop().create_task(self._replace(pool))
                self._replacements.add(task)
                task.add_done_callback(self._replacements.discard)

    async def _replace(self, pool: _Pool) -> None:
        try:
            status = await self._start(pool.spec)
        except Exception as e:  # a replacement that cannot start is retried after the backoff
            self._failed_start(pool, e)
            return
        pool.num_restarts += 1
        logger.warning("controller: replica %s replaces a dead replica of pool %s", status.replica_id, pool.spec.pool)

    async def replicas(self) -> list[tuple[pb.ReplicaStatus, pb.ModelInfo, object]]:
        return [(r.status, r.model, r.handle) for r in self._state.replicas.values()]

    async def register_router(self, status: pb.RouterStatus) -> None:
        self._state.routers[status.router_id] = status

    async def unregister_router(self, router_id: str) -> None:
        self._state.routers.pop(router_id, None)

    async def metrics_address(self) -> str:
        return self.metrics_url

    async def cluster_status(self) -> pb.ClusterStatus:
        """Every replica probed now (not the last health check), the pools and the registered routers."""
        await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))
        return pb.ClusterStatus(
            replicas=[r.status for r in self._state.replicas.values()],
            routers=list(self._state.routers.values()),
            pools=[self._pool_status(name) for name in POOLS],
        )

    def _pool_status(self, name: str) -> pb.PoolStatus:
        pool = self._state.pools[name]
        return pb.PoolStatus(
            pool=name,
            target_replicas=pool.target,
            num_replicas=len(self._state.members(name)),
            num_starting=pool.num_starting,
            num_restarts=pool.num_restarts,
            num_failed_starts=pool.num_failed_starts,
            restart_backoff_s=max(0.0, pool.next_start_s - time.monotonic()),
            last_failure=pool.last_failure,
            num_draining=sum(1 for rid in self._state.members(name) if self._state.replicas[rid].draining),
        )

    async def shutdown(self) -> None:
        """Stop every replica (routers are stopped by whoever started them); nothing is replaced."""
        if self._health_task is not None:
            self._health_task.cancel()
        for task in list(self._replacements):
            task.cancel()
        for pool in self._state.pools.values():
            pool.target = 0
        for replica_id in list(self._state.replicas):
            await self._remove(replica_id)

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))
            self._heal()

    async def _check(self, replica_id: str) -> None:
        replica = self._state.replicas.get(replica_id)
        if replica is None:
            return
        try:
            status = await asyncio.wait_for(replica.handle.status.remote(), self.config.health_check_timeout_s)
        except (ActorUnavailableError, GetTimeoutError, asyncio.TimeoutError):  # maybe passing: count it
            status = None
        except RayActorError as e:  # the actor is gone for good: no point probing it again
            await self._replica_died(replica_id, f"actor died: {str(e).splitlines()[0]}")
            return
        if status is not None and status.healthy:
            status.draining = replica.draining
            replica.status, replica.failed_checks = status, 0
            return
        replica.failed_checks += 1
        replica.status.healthy = False
        if replica.failed_checks >= self.config.max_failed_health_checks:
            what = "reported unhealthy" if status is not None else f"no answer within {self.config.health_check_timeout_s} s"
            await self._replica_died(replica_id, f"{replica.failed_checks} failed health checks ({what})")
