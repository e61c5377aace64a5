"""How a (re)started controller rebuilds its map, and the fence that keeps an old one from acting.

A mixin of ClusterController (router/control/controller.py). At start the controller takes the next
generation from its store (router/control/controller_store.py) and runs ``_recover`` once; every public
act waits for it. ``_recover`` reads the live ``splitserve-*`` actors of the namespace and the
store, sorts them (router/control/reconcile.py ``sort_observed``) and acts: joined replicas are adopted
as they run (same process, same id), half-started ones are stopped with their placement groups,
drains go on from their recorded deadlines, pools are brought back to their targets, and
routers are found again by name (the ones it keeps) or asked for their status (the others)::

    live actors + store ──> adopt / roll back / lost ──> reconcile each pool ──> health loop

Fencing: ``_fence`` compares this controller's generation with the stored one before every act
that starts or stops an actor, and a caller may name the generation it expects
(``_check_generation``); either refuses with StaleGenerationError.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from router.config import NAMESPACE
from router.control import placement
from router.control.cluster_map import MapReplica
from router.control.controller_config import POOLS, StaleGenerationError, parse_replica_name, replica_actor_name
from router.control.controller_store import ReplicaRecord
from router.control.reconcile import next_index, sort_observed
from router.errors import cause_line

logger = logging.getLogger(__name__)

ROUTER_PREFIX = "splitserve-router-"


def _named_actor(name: str):
    """The live actor ``name`` in the namespace; None when there is none."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None




def _router_status(router):
    """Run inside a router actor (``__ray_call__``): its current status, as it registers it."""
    return router._status()


class Recovery:
    """ClusterController's rebuild after a (re)start, and its generation fence."""

    async def _recovered(self) -> None:
        """Wait for the rebuild of a (re)started controller; every public act waits for it."""
        if self._recovery is not None:
            await asyncio.shield(self._recovery)

    def _check_generation(self, generation: int | None) -> None:
        """Refuse an act whose caller names a generation other than this controller's."""
        if generation is not None and generation != self.generation:
            raise StaleGenerationError(f"generation {generation} is stale: this controller is generation {self.generation}")

    async def _fence(self) -> None:
        """Raise StaleGenerationError unless this controller is still the newest (checked before
        every act that starts or stops an actor)."""
        if self.store is None:
            return
        stored = await asyncio.to_thread(self.store.generation)
        if stored != self.generation:
            raise StaleGenerationError(f"controller generation {self.generation} is fenced: generation {stored} has taken over")

    async def _save(self, method: str, *args) -> None:
        """Call the store's ``method`` (a write) off the event loop; nothing without a store."""
        if self.store is not None:
            await asyncio.to_thread(getattr(self.store, method), *args)

    async def _recover(self) -> None:
        """Rebuild the map from the live actors and the store, then act on the difference:
        adopt the replicas that joined, stop the ones that never finished starting, go on with
        (or take back) the drains, and start what the pools and routers lack."""
        pools = await asyncio.to_thread(self.store.pools)
        records = await asyncio.to_thread(self.store.replicas)
        routers = await asyncio.to_thread(self.store.routers)
        self._draining_nodes.update(await asyncio.to_thread(self.store.draining_nodes))
        names = [a["name"] for a in await asyncio.to_thread(ray.util.list_named_actors, True) if a["namespace"] == NAMESPACE]
        live = {name.removeprefix("splitserve-"): parse_replica_name(name) for name in names if parse_replica_name(name) is not None}
        for pool in POOLS:
            self._next_index[pool] = next_index([index for p, index in live.values() if p == pool])
        for name, (spec, target) in pools.items():
            self._state.pools[name].spec, self._state.pools[name].target = spec, target
        observed = sort_observed(live, records)
        for replica_id in observed.lost:
            logger.warning("controller: replica %s died while no controller ran; replacing it", replica_id)
            await asyncio.to_thread(self.store.forget_replica, replica_id)
        await asyncio.gather(*(self._adopt(rid, records[rid]) for rid in observed.adopt))
        await asyncio.gather(*(self._roll_back(rid) for rid in observed.roll_back))
        await self._remove_orphan_groups()
        for router_id, (spec, status) in routers.items():
            self._router_specs[router_id] = spec
            handle = await asyncio.to_thread(_named_actor, replica_actor_name(router_id))
            if handle is not None and status is None:  # its start was cut short: started again below
                ray.kill(handle)
            elif handle is not None:
                self._routers[router_id] = handle
                self._state.routers.setdefault(router_id, status)
        others = [name for name in names if name.startswith(ROUTER_PREFIX) and name.removeprefix("splitserve-") not in routers]
        await asyncio.gather(*(self._find_router(name) for name in others))
        if not (pools or self._router_specs):
            return  # a fresh cluster: set_pool / follow_nodes start the loop
        logger.warning(
            "controller generation %d: adopted %s, rolled back %s, lost %s", self.generation, list(observed.adopt), list(observed.roll_back), list(observed.lost)
        )
        for name, pool in self._state.pools.items():
            if pool.spec is not None and not self.config.follow_nodes:
                await self._reconcile_pool(name, self.config.drain_timeout_s, start_now=False)
        for router_id in list(self._router_specs):
            await self._check_router(router_id)
        self._ensure_health_loop()

    async def _find_router(self, name: str) -> None:
        """Register a live router that someone else keeps (a ``splitserve router`` pod) again."""
        handle = await asyncio.to_thread(_named_actor, name)
        try:
            status = await asyncio.wait_for(handle.__ray_call__.remote(_router_status), self.config.health_check_timeout_s)
        except (AttributeError, RayActorError, ActorUnavailableError, asyncio.TimeoutError):
            return  # gone, or not started yet: it registers itself when it starts
        if status.grpc_address:
            self._state.routers.setdefault(status.router_id, status)

    async def _adopt(self, replica_id: str, record: ReplicaRecord) -> None:
        handle = await asyncio.to_thread(_named_actor, replica_actor_name(replica_id))
        try:
            if handle is None:
                raise RayActorError()
            model = await asyncio.wait_for(handle.model_info.remote(), self.config.health_check_timeout_s)
            status = await asyncio.wait_for(handle.status.remote(), self.config.health_check_timeout_s)
            endpoints = await asyncio.wait_for(handle.kv_endpoints.remote(), self.config.health_check_timeout_s) if record.pool == "decode" else ()
        except (RayActorError, ActorUnavailableError, asyncio.TimeoutError) as e:
            logger.warning("controller: replica %s does not answer (%s); replacing it", replica_id, cause_line(e))
            await asyncio.to_thread(self.store.forget_replica, replica_id)
            if handle is not None:
                ray.kill(handle)
            placement.release(await asyncio.to_thread(placement.find_replica_groups, replica_actor_name(replica_id)))
            return
        groups = await asyncio.to_thread(placement.find_replica_groups, replica_actor_name(replica_id))
        lived_s = max(0.0, time.time() - record.started_unix_s)
        replica = MapReplica(
            handle, model, status, time.monotonic() - lived_s, placement_groups=tuple(groups), node_id=record.node_id, draining=record.draining
        )
        replica.status.draining = record.draining
        if endpoints:
            self._state.kv_endpoints[replica_id] = endpoints
        self._state.replicas[replica_id] = replica
        if record.draining:
            self._spawn(self._drain(replica_id, max(0.0, record.drain_deadline_unix_s - time.time())))

    async def _roll_back(self, replica_id: str) -> None:
        """Stop a replica whose start the old controller never finished, and make its peers forget it."""
        logger.warning("controller: replica %s never finished starting; stopping it", replica_id)
        handle = await asyncio.to_thread(_named_actor, replica_actor_name(replica_id))
        if handle is None:
            return
        pool, _ = parse_replica_name(replica_actor_name(replica_id))
        if pool == "decode":
            try:
                endpoints = await asyncio.wait_for(handle.kv_endpoints.remote(), self.config.health_check_timeout_s)
            except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
                endpoints = ()
            names = [e.agent_name for e in endpoints or ()]
            prefill = [r.handle for r in self._state.replicas.values() if r.status.pool == "prefill"]
            if names:
                await asyncio.gather(*(p.remove_kv_peers.remote(names) for p in prefill), return_exceptions=True)
        else:
            decode = [r.handle for r in self._state.replicas.values() if r.status.pool == "decode"]
            await asyncio.gather(*(d.remove_prefill_peer.remote(replica_id) for d in decode), return_exceptions=True)
        ray.kill(handle)
        placement.release(await asyncio.to_thread(placement.find_replica_groups, replica_actor_name(replica_id)))

    async def _remove_orphan_groups(self) -> None:
        """Remove the placement groups (every stage's) of replicas that are not in the map (their start was cut short)."""
        groups = await asyncio.to_thread(placement.live_group_names)
        for name, group in groups.items():
            owner = placement.replica_of_group(name)
            if parse_replica_name(owner) is not None and owner.removeprefix("splitserve-") not in self._state.replicas:
                logger.warning("controller: removing placement group %s of a replica that never joined", name)
                placement.release(group)

