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

Pool sizes come from ``set_pool`` / ``scale_pool`` (``splitserve up``, the planner on Ray), or,
with ``follow_nodes`` (``splitserve head`` on Kubernetes), from the Ray nodes themselves: each
health round reads ``ray.nodes()``, keeps one replica pinned to every slot of a pool's resource
(router/control/node_slots.py) and forgets the replicas of nodes that are gone. A worker pod that is
being stopped calls ``drain_node`` first, so its replicas finish what they run before its node goes.

Surviving its own death: replicas and routers are detached actors named in the namespace, so they
outlive this actor, which Ray restarts (``max_restarts=-1``, router/control/launch.py). A restarted
controller takes the next generation and rebuilds its map from the live ``splitserve-*`` actors
and the few facts router/control/controller_store.py keeps (pool specs and targets, joins, drains,
routers); then it acts on the difference (router/control/reconcile.py): adopted replicas stay, half-started
ones are stopped, a drain goes on or is taken back, missing replicas and dead routers are started.
Every act that starts or stops an actor first checks that its generation is still the stored one
(``StaleGenerationError`` otherwise), so an old controller never races a new one's acts.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections import Counter
from collections.abc import Collection

import ray
from prometheus_client import CollectorRegistry, start_http_server
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from proto import splitserve_pb2 as pb
from router.config import CONTROLLER_NAME, NAMESPACE
from router.control import placement
from router.control.cluster_map import ClusterMap, ControllerCollector, MapReplica, PoolState, ReplicaCollector
from router.control.controller_config import (
    POOLS,
    ControllerConfig,
    ReplicaSpec,
    RouterSpec,
    StaleGenerationError,
    pool_resource,
    replica_actor_name,
)
from router.control.controller_nodes import NodeFollowing
from router.control.controller_recovery import Recovery
from router.control.controller_routers import RouterKeeping
from router.control.controller_store import ControllerHistory, ControllerStore, ReplicaRecord
from router.control.reconcile import plan_pool

__all__ = [
    "CONTROLLER_NAME", "NAMESPACE", "POOLS", "ClusterController", "ControllerConfig", "ReplicaSpec", "RouterSpec", "StaleGenerationError", "pool_resource",
]

logger = logging.getLogger(__name__)


def _in_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _reason(error: Exception) -> str:
    """One line saying why a call into a replica failed (the worker's own exception for a task error)."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


class ClusterController(Recovery, RouterKeeping, NodeFollowing):
    """Pools, replicas, routers and health. Run as a named async Ray actor."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._state = ClusterMap()
        self._next_index = dict.fromkeys(POOLS, 0)
        self._routers: dict[str, object] = {}
        """Router id -> handle of the routers this controller keeps alive."""
        self._router_specs: dict[str, RouterSpec] = {}
        self._routers_starting: set[str] = set()
        self._recovery: asyncio.Task | None = None
        self.num_router_restarts = 0
        self._health_task: asyncio.Task | None = None
        self._replacements: set[asyncio.Task] = set()
        self._introducing = asyncio.Lock()
        self._reserving_id = asyncio.Lock()
        self._draining_nodes: dict[str, float] = {}
        """Node id -> drain timeout of the nodes being drained: their slots count for no pool."""
        self._starting_on: Counter[tuple[str, str]] = Counter()
        """(pool, node id) -> replicas being started there by the node follower."""
        # Outside a Ray actor (unit tests build one directly) there is nothing to recover or fence.
        self.store = ControllerStore() if _in_actor() else None
        restarted = bool(self.store and ray.get_runtime_context().was_current_actor_reconstructed)
        # Following the nodes (Kubernetes), a new controller adopts what the last one left running:
        # a head restarted with its GCS on Redis finds its workers serving and keeps them.
        self.history = self.store.begin_generation(restarted, keep_cluster=config.follow_nodes) if self.store else ControllerHistory(0, 0, 0.0)
        restarted = self.history.last_restart_unix_s > 0  # this start went on with a cluster
        self.generation = self.history.generation
        registry = CollectorRegistry()
        registry.register(ReplicaCollector(self._state))
        registry.register(ControllerCollector(lambda: (self.history, self.num_router_restarts)))
        server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
        self.metrics_url = f"http://{config.metrics_host}:{server.server_port}/metrics"
        if self.store is not None:
            if restarted:
                logger.warning("controller: restarted as generation %d (restart %d); rebuilding the map", self.generation, self.history.num_restarts)
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def controller_history(self) -> ControllerHistory:
        """This controller's generation and how often it was restarted."""
        return self.history

    async def set_pool(self, spec: ReplicaSpec, num_replicas: int, generation: int | None = None) -> list[pb.ReplicaStatus]:
        """Keep ``spec.pool`` at ``num_replicas`` replicas started from ``spec``: start the missing
        ones now (all at once; raises if one fails, after stopping it) or remove the newest surplus
        ones. Returns the statuses of the replicas started. With ``generation``, refused unless it
        is this controller's (as every act here)."""
        if num_replicas < 0:
            raise ValueError(f"num_replicas: must be >= 0, got {num_replicas}")
        self._check_generation(generation)
        await self._recovered()
        await self._fence()
        pool = self._state.pools[spec.pool]
        pool.spec, pool.target = spec, num_replicas
        await self._save("save_pool", spec.pool, spec, num_replicas)
        members = self._state.members(spec.pool)
        for replica_id in members[num_replicas:][::-1]:
            await self._remove(replica_id)
        return await self._start_missing(pool, spec, num_replicas - len(members) - pool.num_starting)

    async def add_replica(self, spec: ReplicaSpec, generation: int | None = None) -> pb.ReplicaStatus:
        """Grow ``spec.pool`` by one replica started from ``spec``; returns its first status.
        A replica that fails to start is stopped, and the pool's target is left as it was."""
        self._check_generation(generation)
        await self._recovered()
        started = await self._start(spec)
        pool = self._state.pools[spec.pool]
        pool.spec, pool.target = spec, pool.target + 1
        await self._save("save_pool", spec.pool, spec, pool.target)
        return started

    async def scale_pool(self, pool_name: str, target: int, drain_timeout_s: float = 300.0, generation: int | None = None) -> None:
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
        if self.config.follow_nodes:
            raise ValueError(f"pool {pool_name!r} follows the Ray nodes (follow_nodes): scale its worker group instead")
        self._check_generation(generation)
        await self._recovered()
        pool = self._state.pools[pool_name]
        if pool.spec is None:
            raise ValueError(f"pool {pool_name!r} was never started: no spec to start replicas from")
        await self._fence()
        pool.target = target
        await self._save("save_pool", pool_name, pool.spec, target)
        await self._reconcile_pool(pool_name, drain_timeout_s, start_now=True)

    async def _reconcile_pool(self, pool_name: str, drain_timeout_s: float, start_now: bool) -> None:
        """Act on the difference between a pool's target and its replicas (router/control/reconcile.py):
        take back drains, drain the newest surplus, start what is missing (now, raising if one
        fails, or ``start_now`` False: in the background, retried after the backoff)."""
        pool = self._state.pools[pool_name]
        members = [self._state.replicas[rid] for rid in self._state.members(pool_name)]
        active = [r.status.replica_id for r in members if not r.draining]
        draining = [r.status.replica_id for r in members if r.draining and r.node_id not in self._draining_nodes]
        plan = plan_pool(pool.target, active, draining, pool.num_starting)
        for replica_id in plan.undrain:
            await self._set_draining(replica_id, False)
        for replica_id in plan.drain:
            await self._drain_in_background(replica_id, drain_timeout_s)
        if start_now:
            await self._start_missing(pool, pool.spec, plan.num_to_start)
        else:
            self._heal()

    async def _start_missing(self, pool: PoolState, spec: ReplicaSpec, missing: int) -> list[pb.ReplicaStatus]:
        """Start ``missing`` replicas at once (none when it is 0 or less); their statuses. If one
        fails, the pool stays short: the failure is counted and replacements follow after the backoff."""
        missing = max(0, missing)
        pool.num_starting += missing  # counted now, as in _heal
        try:
            return list(await asyncio.gather(*(self._start(spec, counted=True) for _ in range(missing))))
        except Exception as e:
            self._failed_start(pool, e)
            raise

    async def _set_draining(self, replica_id: str, draining: bool, timeout_s: float = 0.0) -> None:
        """Mark a replica draining (or not), recorded first: a restarted controller goes on with it."""
        replica = self._state.replicas[replica_id]
        await self._save("save_replica", self._record(replica_id, replica, draining, time.time() + timeout_s))
        replica.draining = replica.status.draining = draining

    def _record(self, replica_id: str, replica: MapReplica, draining: bool = False, drain_deadline_unix_s: float = 0.0) -> ReplicaRecord:
        started_unix_s = time.time() - (time.monotonic() - replica.started_s)
        return ReplicaRecord(replica_id, replica.status.pool, replica.node_id, started_unix_s, draining, drain_deadline_unix_s if draining else 0.0)

    async def _drain_in_background(self, replica_id: str, timeout_s: float) -> None:
        await self._set_draining(replica_id, True, timeout_s)
        self._spawn(self._drain(replica_id, timeout_s))

    def _spawn(self, coroutine) -> None:
        """Run ``coroutine`` as a task the controller keeps (and cancels at shutdown)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._replacements.add(task)
        task.add_done_callback(self._replacements.discard)

    def _ensure_health_loop(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._check_health_forever())

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

    async def remove_replica(self, replica_id: str, generation: int | None = None) -> bool:
        """Stop a replica for good: its pool's target shrinks by one (it is not replaced)."""
        self._check_generation(generation)
        await self._recovered()
        replica = self._state.replicas.get(replica_id)
        if replica is None:
            return False
        await self._fence()
        pool = self._state.pools[replica.status.pool]
        pool.target = max(0, pool.target - 1)
        if pool.spec is not None:
            await self._save("save_pool", pool.spec.pool, pool.spec, pool.target)
        return await self._remove(replica_id)

    async def _start(self, spec: ReplicaSpec, node_id: str | None = None, counted: bool = False) -> pb.ReplicaStatus:
        """Start a replica (on Ray node ``node_id``, or where Ray finds room) and wait until its
        model is loaded and it is introduced to the others. ``counted``: the caller already
        added it to the pool's ``num_starting`` (when it decided to start it, so that no pass
        in between starts a second one for the same slot)."""
        self._ensure_health_loop()
        module, _, name = spec.actor_class.partition(":")
        actor_class = ray.remote(getattr(importlib.import_module(module), name))
        pool = self._state.pools[spec.pool]
        if not counted:
            pool.num_starting += 1
        group = handle = replica_id = None
        try:
            await self._fence()
            replica_id = await self._new_replica_id(spec.pool)
            options = dict(num_cpus=spec.num_cpus, resources={pool_resource(spec.pool): 1})
            if spec.num_ranks > 1:
                stages = placement.stage_bundles(spec.pp_size, spec.tp_size, spec.num_cpus, spec.tp_rank_cpus, pool_resource(spec.pool), spec.tp_rank_gpus)
                group = await placement.reserve_stages(
                    f"a {spec.shape} {spec.pool} replica", stages, spec.placement_timeout_s, node_id, name=replica_actor_name(replica_id), num_layers=spec.num_layers
                )
                strategy = PlacementGroupSchedulingStrategy(group[0], placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
                options.update(scheduling_strategy=strategy, num_gpus=spec.tp_rank_gpus)
            else:
                if spec.tp_rank_gpus:  # a replica of one rank on a GPU: without a reservation Ray hides every GPU from it
                    options.update(num_gpus=spec.tp_rank_gpus)
                if node_id is not None:
                    options.update(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            handle = actor_class.options(
                name=replica_actor_name(replica_id), namespace=NAMESPACE, lifetime="detached", max_concurrency=10_000, max_restarts=0, **options
            ).remote(replica_id, *spec.init_args)
            model = await handle.model_info.remote()
            status = await handle.status.remote()
            node_id = node_id or await handle.__ray_call__.remote(placement.actor_node_id)
            async with self._introducing:  # one at a time: each sees every replica introduced before it
                await self._fence()  # a newer controller may have taken over while this one loaded
                await self._introduce(replica_id, spec.pool, handle)
                replica = MapReplica(handle, model, status, time.monotonic(), placement_groups=tuple(group or ()), node_id=node_id)
                await self._save("save_replica", self._record(replica_id, replica))  # joined: adopted after a restart
                self._state.replicas[replica_id] = replica  # routers may pick it from now on
        except BaseException:
            if replica_id is not None:
                self._state.kv_endpoints.pop(replica_id, None)
            if handle is not None:
                ray.kill(handle)  # never leave a half-started replica running
            placement.release(group)
            raise
        finally:
            pool.num_starting -= 1
        return status

    async def _new_replica_id(self, pool: str) -> str:
        """A replica id never handed out before, by this controller or an earlier generation."""
        async with self._reserving_id:  # one at a time: two starts never read the same next index
            index = self._next_index[pool]
            if self.store is not None:
                index = await asyncio.to_thread(self.store.reserve_id, pool, index)
            self._next_index[pool] = index + 1
        return f"{pool}-{index}"

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
        if replica_id not in self._state.replicas:
            return False
        await self._fence()
        replica = self._state.replicas.pop(replica_id, None)
        if replica is None:
            return False
        await self._save("forget_replica", replica_id)
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
        placement.release(replica.placement_groups)
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

    def _failed_start(self, pool: PoolState, error: Exception) -> None:
        pool.num_failed_starts += 1
        pool.last_failure = f"start failed: {_reason(error)}"
        self._back_off(pool)
        logger.warning("controller: a replica of pool %s failed to start (%s); next try in %.1f s",
                       pool.spec.pool, pool.last_failure, pool.next_start_s - time.monotonic())

    def _back_off(self, pool: PoolState) -> None:
        pool.num_young_failures += 1
        delay = min(self.config.max_restart_backoff_s, self.config.restart_backoff_s * 2 ** (pool.num_young_failures - 1))
        pool.next_start_s = time.monotonic() + delay

    def _heal(self) -> None:
        """Start a replacement for every replica a pool lacks, unless its backoff runs. Pools
        that follow the nodes are refilled by the next node round instead (in their own slots)."""
        if self.config.follow_nodes:
            return
        now = time.monotonic()
        for name, pool in self._state.pools.items():
            if pool.spec is None or now < pool.next_start_s:
                continue
            for _ in range(pool.target - len(self._state.members(name)) - pool.num_starting):
                pool.num_starting += 1  # counted now: a pass before the task runs must not start it again
                self._spawn(self._replace(pool))

    async def _replace(self, pool: PoolState) -> None:
        try:
            status = await self._start(pool.spec, counted=True)
        except Exception as e:  # a replacement that cannot start is retried after the backoff
            self._failed_start(pool, e)
            return
        pool.num_restarts += 1
        logger.warning("controller: replica %s replaces a dead replica of pool %s", status.replica_id, pool.spec.pool)

    async def replicas(self, known: Collection[str] = ()) -> list[tuple[pb.ReplicaStatus, pb.ModelInfo, object]]:
        """Each replica's status, model and actor handle, with ``None`` for the handle of a replica
        in ``known``. Routers poll this (every ``worker_refresh_interval_s``) and keep the handles
        they have: a handle sent again costs both processes Ray's reference bookkeeping, more than
        the statuses themselves (4.0 to 4.9 ms of CPU per call with two replicas, against 1.7 to
        1.9 ms without the handles). A controller never reuses a replica id."""
        await self._recovered()  # a map half rebuilt would make routers drop replicas that are alive
        known = frozenset(known)
        return [(r.status, r.model, None if replica_id in known else r.handle) for replica_id, r in self._state.replicas.items()]

    async def register_router(self, status: pb.RouterStatus) -> None:
        self._state.routers[status.router_id] = status

    async def unregister_router(self, router_id: str) -> None:
        self._state.routers.pop(router_id, None)

    async def metrics_address(self) -> str:
        return self.metrics_url

    async def cluster_status(self) -> pb.ClusterStatus:
        """Every replica probed now (not the last health check), the pools and the registered routers."""
        await self._recovered()
        await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))
        history = self.history
        return pb.ClusterStatus(
            replicas=[r.status for r in self._state.replicas.values()],
            routers=list(self._state.routers.values()),
            pools=[self._pool_status(name) for name in POOLS],
            controller=pb.ControllerStatus(
                generation=history.generation, num_restarts=history.num_restarts,
                last_restart_unix_s=history.last_restart_unix_s, num_router_restarts=self.num_router_restarts,
            ),
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
        """Stop the routers it keeps and every replica (they are detached: nothing else would),
        and forget the cluster: a controller started later starts from nothing."""
        await self._recovered()
        if self._health_task is not None:
            self._health_task.cancel()
        tasks = list(self._replacements)
        for task in tasks:
            task.cancel()
        if tasks:  # let each cancelled start stop its actor and release its group before this returns
            await asyncio.wait(tasks, timeout=self.config.health_check_timeout_s)
        self._router_specs.clear()
        await asyncio.gather(*(self._stop_router(rid) for rid in list(self._routers)))
        for pool in self._state.pools.values():
            pool.target = 0
        for replica_id in list(self._state.replicas):
            await self._remove(replica_id)
        await self._save("clear")

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self._health_round()
            except StaleGenerationError as e:
                logger.error("controller: %s; this controller stops acting", e)
                return

    async def _health_round(self) -> None:
        if self.config.follow_nodes:
            try:
                await self._follow_nodes_once()
            except StaleGenerationError:
                raise
            except Exception:  # the GCS may be briefly unreachable: try again next round
                logger.exception("controller: following the Ray nodes failed")
        await asyncio.gather(*(self._check(rid) for rid in list(self._state.replicas)))
        await asyncio.gather(*(self._check_router(rid) for rid in list(self._router_specs)))
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
