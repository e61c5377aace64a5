"""The planner's connector to a splitserve cluster on Ray: the controller starts and drains replicas.

``pools()`` reads the controller's cluster status: a replica is ready once it is in the map
(the controller adds it only after its model loaded and its first health probe answered) and
healthy; draining replicas are counted apart. ``set_replicas`` calls ``scale_pool``: missing
replicas start at once, surplus ones drain (no new request, the running ones finish) and then
leave the map.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError, RayTaskError

from planner.connector import POOLS, ConnectorError, PoolReplicas
from router.control.controller import CONTROLLER_NAME, NAMESPACE
from router.errors import cause_line


class RayConnector:
    """Acts on the cluster whose controller is ``controller`` (by default the named one of this Ray)."""

    def __init__(self, controller=None, drain_timeout_s: float = 300.0) -> None:
        self.controller = controller or ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        self.drain_timeout_s = drain_timeout_s

    async def pools(self) -> dict[str, PoolReplicas]:
        try:
            status = await self.controller.cluster_status.remote()
        except (RayActorError, RayTaskError) as e:
            raise ConnectorError(f"cluster status from the controller failed: {cause_line(e)}") from e
        out = {}
        for pool in status.pools:
            members = [r for r in status.replicas if r.pool == pool.pool]
            out[pool.pool] = PoolReplicas(
                pool=pool.pool,
                target=pool.target_replicas,
                ready=sum(1 for r in members if r.healthy and not r.draining),
                starting=pool.num_starting,
                draining=sum(1 for r in members if r.draining),
            )
        return {name: out.get(name, PoolReplicas(name, 0, 0)) for name in POOLS}

    async def set_replicas(self, pool: str, target: int) -> None:
        try:
            await self.controller.scale_pool.remote(pool, target, self.drain_timeout_s)
        except (RayActorError, RayTaskError) as e:
            raise ConnectorError(f"scaling pool {pool} to {target} failed: {cause_line(e)}") from e

