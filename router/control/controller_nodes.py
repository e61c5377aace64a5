"""Pools that follow the Ray nodes (Kubernetes), and draining a node before its pod goes.

A mixin of ClusterController (router/control/controller.py), which owns the state it reads. With
``follow_nodes`` each health round reads ``ray.nodes()``, keeps one replica pinned to every slot
of a pool's resource (router/control/node_slots.py) and forgets the replicas of nodes that are gone. A
worker pod that is being stopped calls ``drain_node`` first, so its replicas finish what they
run before its node goes; the nodes being drained are kept in the store, so a restarted
controller does not refill their slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import ray

from router.control.cluster_map import PoolState
from router.control.controller_config import ReplicaSpec, pool_resource
from router.control.node_slots import alive_node_ids, node_slots, slots_to_fill

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.2
"""How often drain_node looks whether its node is empty yet."""


class NodeFollowing:
    """ClusterController's ``drain_node``, ``follow_nodes`` and the per-round ``_follow_nodes_once``."""

    async def drain_node(self, node_id: str, timeout_s: float = 300.0) -> list[str]:
        """Drain every replica on Ray node ``node_id`` (its pod is being stopped): routers send
        them nothing new, their running requests finish (or they are removed after ``timeout_s``),
        then they leave the map, which tells routers that their cached prefixes are gone. The
        node's slots count for no pool from now on, so nothing replaces them there; a replica
        still starting there is drained once it has started. Returns when none is left on the
        node, with the ids of the replicas drained."""
        if timeout_s < 0:
            raise ValueError(f"timeout_s: must be >= 0, got {timeout_s}")
        await self._recovered()
        self._draining_nodes[node_id] = timeout_s
        await self._save("save_draining_node", node_id, timeout_s)
        deadline = time.monotonic() + timeout_s
        drained = []
        while True:
            on_node = [rid for rid, r in self._state.replicas.items() if r.node_id == node_id]
            for replica_id in on_node:
                if not self._state.replicas[replica_id].draining:
                    if not self.config.follow_nodes:  # its pool shrinks: no replacement anywhere
                        pool = self._state.pools[self._state.replicas[replica_id].status.pool]
                        pool.target = max(0, pool.target - 1)
                        await self._save("save_pool", pool.spec.pool, pool.spec, pool.target)
                    await self._drain_in_background(replica_id, max(0.0, deadline - time.monotonic()))
                    drained.append(replica_id)
            starting = sum(n for (_, nid), n in self._starting_on.items() if nid == node_id)
            if not on_node and not starting:
                return drained
            if time.monotonic() > deadline + self.config.health_check_timeout_s:
                logger.warning("controller: node %s still holds %s after its drain timeout", node_id, on_node)
                return drained
            await asyncio.sleep(_DRAIN_POLL_S)

    async def follow_nodes(self, specs: list[ReplicaSpec]) -> None:
        """Start keeping each pool of ``specs`` at one replica per slot of its resource on the
        alive nodes (``node_slots``): fill the slots now, then every health round."""
        if not self.config.follow_nodes:
            raise ValueError("follow_nodes: off in this controller's config; set_pool sizes its pools")
        await self._recovered()
        for spec in specs:
            self._state.pools[spec.pool].spec = spec
            await self._save("save_pool", spec.pool, spec, self._state.pools[spec.pool].target)
        self._ensure_health_loop()
        await self._follow_nodes_once()

    async def _follow_nodes_once(self) -> None:
        """One round of following the nodes: forget the replicas of nodes that are gone, drain
        those that started on a draining node, set each pool's target to its slots and start a
        replica in every free slot (unless the pool is backing off after failures)."""
        nodes = await asyncio.to_thread(ray.nodes)
        alive = alive_node_ids(nodes)
        for node_id in [n for n in self._draining_nodes if n not in alive]:
            del self._draining_nodes[node_id]
            await self._save("forget_draining_node", node_id)
        for replica_id, replica in list(self._state.replicas.items()):
            if replica.node_id and replica.node_id not in alive:
                logger.warning("controller: node %s of replica %s is gone; forgetting the replica", replica.node_id, replica_id)
                await self._remove(replica_id)
            elif replica.node_id in self._draining_nodes and not replica.draining:
                await self._drain_in_background(replica_id, self._draining_nodes[replica.node_id])
        for name, pool in self._state.pools.items():
            if pool.spec is None:
                continue
            slots = node_slots(nodes, pool_resource(name), exclude=self._draining_nodes)
            pool.target = sum(slots.values())
            if time.monotonic() < pool.next_start_s:
                continue
            used = Counter(self._state.replicas[rid].node_id for rid in self._state.members(name))
            used.update({nid: n for (p, nid), n in self._starting_on.items() if p == name})
            for node_id in slots_to_fill(slots, used):
                self._starting_on[(name, node_id)] += 1  # counted now: the next round must not start it again
                self._spawn(self._start_on(pool, node_id))

    async def _start_on(self, pool: PoolState, node_id: str) -> None:
        key = (pool.spec.pool, node_id)
        try:
            status = await self._start(pool.spec, node_id)
            logger.info("controller: replica %s started on node %s", status.replica_id, node_id)
        except Exception as e:  # the slot stays free: retried after the backoff
            self._failed_start(pool, e)
        finally:
            self._starting_on[key] -= 1
            if not self._starting_on[key]:
                del self._starting_on[key]

