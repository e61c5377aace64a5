"""RouterReplica: an async Ray actor that serves the gRPC API.

It keeps a WorkerDirectory fresh from the controller in the background and flips its health
service to SERVING while at least one decode replica is healthy.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from prometheus_client import start_http_server

from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.controller import CONTROLLER_NAME, NAMESPACE
from router.metrics import RouterMetrics
from router.server import RunningServer, start_server
from router.service import AdminService, GenerationService
from router.workers import WorkerDirectory

logger = logging.getLogger(__name__)


class RouterReplica:
    """One router: gRPC server, worker directory, metrics endpoint."""

    def __init__(self, router_id: str, config: RouterConfig) -> None:
        self.router_id = router_id
        self.config = config
        self.directory = WorkerDirectory()
        self.metrics = RouterMetrics(router_id)
        self._controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        self._server: RunningServer | None = None
        self._refresh_task: asyncio.Task | None = None
        self._generation = GenerationService(config, self.directory, self.metrics)
        metrics_server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=self.metrics.registry)
        self.metrics_url = f"http://{config.metrics_host}:{metrics_server.server_port}/metrics"

    async def start(self) -> pb.RouterStatus:
        """Fetch the worker map, start serving, register with the controller."""
        await self._refresh()
        admin = AdminService(self._cluster_status)
        self._server = await start_server(self.config, self._generation, admin)
        await self._server.set_serving(bool(self.directory.served_models()))
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_forever())
        status = self._status()
        await self._controller.register_router.remote(status)
        return status

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace_s``, unregister."""
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        if self._server is not None:
            await self._server.set_serving(False)
            await self._server.server.stop(grace_s)
        await self._controller.unregister_router.remote(self.router_id)

    def _status(self) -> pb.RouterStatus:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else socket.gethostname()
        return pb.RouterStatus(
            router_id=self.router_id,
            grpc_address=f"{host}:{self._server.port}" if self._server else "",
            num_inflight=self._generation.num_inflight,
            metrics_url=self.metrics_url,
        )

    async def _cluster_status(self) -> pb.ClusterStatus:
        await self._controller.register_router.remote(self._status())
        return await self._controller.cluster_status.remote()

    async def _refresh(self) -> None:
        self.directory.update(await self._controller.replicas.remote())
        if self._server is not None:
            await self._server.set_serving(bool(self.directory.served_models()))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.worker_refresh_interval_s)
            try:
                await self._refresh()
            except (RayActorError, ActorUnavailableError) as e:
                # The controller is restarting or gone: keep serving the last known map.
                logger.warning("router %s: worker map refresh failed: %s", self.router_id, str(e).splitlines()[0])
