"""The routers a controller keeps alive: started by it, probed every health round, and started
again (on the ports they listened on) when they die.

A mixin of ClusterController (router/control/controller.py), which owns the state it reads: the
cluster map, the store, the fence and the task set. Routers are detached actors named
``splitserve-<router_id>``, so they outlive the controller and keep serving from their last
worker map while it restarts; a restarted controller finds them by name (controller_recovery.py).
Routers started by someone else (``splitserve router`` pods) only register; their owner keeps them.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from dataclasses import replace

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from proto import splitserve_pb2 as pb
from router.config import NAMESPACE
from router.control.controller_config import RouterSpec, StaleGenerationError, replica_actor_name
from router.control.reconcile import pinned_ports
from router.errors import cause_line

logger = logging.getLogger(__name__)


def _router_id(router) -> str:
    """Run inside a router actor (``__ray_call__``): its id; answering at all means it is alive."""
    return router.router_id



class RouterKeeping:
    """ClusterController's routers: ``set_routers`` and the per-round ``_check_router``."""

    async def set_routers(self, specs: list[RouterSpec], generation: int | None = None) -> list[pb.RouterStatus]:
        """Start the routers of ``specs`` (all at once) and keep each alive from now on: a router
        that dies is started again with its spec, on the ports it listened on. Returns their
        statuses, in ``specs`` order; raises if one fails to start (the others keep running)."""
        self._check_generation(generation)
        await self._recovered()
        for spec in specs:
            self._router_specs[spec.router_id] = spec
            self._routers_starting.add(spec.router_id)  # before any await: a health round must not start it too
        for spec in specs:
            await self._save("save_router", spec, None)  # known before it starts: a restart finishes its start
        self._ensure_health_loop()
        return list(await asyncio.gather(*(self._start_router(spec) for spec in specs)))

    async def _start_router(self, spec: RouterSpec) -> pb.RouterStatus:
        """Start one router; the caller has put its id in ``_routers_starting`` (taken out here)."""
        try:
            await self._fence()
        except BaseException:
            self._routers_starting.discard(spec.router_id)
            raise
        module, _, name = spec.actor_class.partition(":")
        actor_class = ray.remote(getattr(importlib.import_module(module), name))
        options = dict(name=replica_actor_name(spec.router_id), namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=10_000)
        if spec.node_id is not None:
            options.update(scheduling_strategy=NodeAffinitySchedulingStrategy(spec.node_id, soft=False))
        handle = None
        try:
            handle = actor_class.options(**options).remote(spec.router_id, spec.config)
            status = await handle.start.remote()
            pinned = replace(spec, config=replace(spec.config, **pinned_ports(status.grpc_address, status.http_url)))
            await self._save("save_router", pinned, status)
        except BaseException:
            if handle is not None:
                ray.kill(handle)
            raise
        finally:
            self._routers_starting.discard(spec.router_id)
        self._router_specs[spec.router_id] = pinned
        self._routers[spec.router_id] = handle
        self._state.routers[spec.router_id] = status
        return status

    async def _stop_router(self, router_id: str) -> None:
        handle = self._routers.pop(router_id, None)
        self._state.routers.pop(router_id, None)
        await self._save("forget_router", router_id)
        if handle is None:
            return
        try:
            await asyncio.wait_for(handle.stop.remote(), self.config.health_check_timeout_s)
        except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
            pass  # gone or stuck: killed below either way
        ray.kill(handle)

    async def _check_router(self, router_id: str) -> None:
        """Start a router again if it died (and no start of it runs)."""
        if router_id in self._routers_starting:
            return
        handle = self._routers.get(router_id)
        if handle is not None:
            try:
                await asyncio.wait_for(handle.__ray_call__.remote(_router_id), self.config.health_check_timeout_s)
                return
            except (ActorUnavailableError, asyncio.TimeoutError):
                return  # maybe passing; a dead router raises RayActorError
            except RayActorError as e:
                logger.warning("controller: router %s died (%s); starting it again", router_id, str(e).splitlines()[0])
        self._routers.pop(router_id, None)
        self._state.routers.pop(router_id, None)
        self._routers_starting.add(router_id)  # held until the start below runs
        self._spawn(self._replace_router(router_id))

    async def _replace_router(self, router_id: str) -> None:
        spec = self._router_specs.get(router_id)
        if spec is None:
            self._routers_starting.discard(router_id)
            return
        try:
            await self._start_router(spec)
        except StaleGenerationError:
            raise
        except Exception as e:  # its port may still be held: tried again next round
            logger.warning("controller: router %s failed to start again (%s)", router_id, cause_line(e))
            return
        self.num_router_restarts += 1

