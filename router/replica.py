"""RouterReplica: an async Ray actor that serves the gRPC API (and, with ``http_port`` set, the
OpenAI-compatible and KServe v2 HTTP API from the same event loop).

It keeps a WorkerDirectory fresh from the controller in the background and flips its health
service to SERVING while at least one decode replica is healthy. When routing is cache-aware (two
or more prefill replicas), it also pulls every worker's KV events into its PrefixIndex: numbered
batches after the last one it applied, or a snapshot when it is new or finds a gap.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from prometheus_client import start_http_server

from kv_store.events import EventGap, Tier
from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.config import CONTROLLER_NAME, NAMESPACE
from router.frontend.auth import read_token
from router.frontend.metrics import RouterMetrics
from router.frontend.server import RunningServer, start_server
from router.frontend.service import AdminService, GenerationService
from router.routing.policy import PolicyConfig, make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.worker_calls import ChannelStats, WorkerChannels
from router.routing.workers import Replica, WorkerDirectory, worker_load

if TYPE_CHECKING:
    from router.frontend.apis.app import HttpServer

logger = logging.getLogger(__name__)


def _advertised(bind_host: str) -> str:
    """The address others reach a server bound to ``bind_host`` at: the node's IP (a pod's IP on
    Kubernetes) for a wildcard bind, which is no address to dial (the planner would scrape itself)."""
    return ray.util.get_node_ip_address() if bind_host in ("0.0.0.0", "::", "") else bind_host


class RouterReplica:
    """One router: gRPC server, worker directory, metrics endpoint."""

    def __init__(self, router_id: str, config: RouterConfig) -> None:
        self.router_id = router_id
        self.config = config
        self.directory = WorkerDirectory()
        self.metrics = RouterMetrics(router_id)
        self._controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        self._server: RunningServer | None = None
        self._http: HttpServer | None = None
        self._refresh_task: asyncio.Task | None = None
        self._events_task: asyncio.Task | None = None
        self.index = PrefixIndex()
        policy_config = PolicyConfig(memory_s=config.routing_memory_s, local_prefill_max_tokens=config.local_prefill_max_tokens)
        self.policy = make_policy(config.routing_policy, self.index, policy_config)
        self.channels = WorkerChannels(router_id, config.cluster_tls)
        self._generation = GenerationService(config, self.directory, self.metrics, self.policy, self.channels)
        metrics_server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=self.metrics.registry)
        self.metrics_url = f"http://{_advertised(config.metrics_host)}:{metrics_server.server_port}/metrics"

    async def start(self) -> pb.RouterStatus:
        """Fetch the worker map, start serving, register with the controller."""
        await self._refresh()
        admin = AdminService(self._cluster_status)
        self._server = await start_server(self.config, self._generation, admin)
        if self.config.http_port is not None:
            # Imported here: FastAPI, uvicorn and Starlette cost a process 0.3 CPU-s, and most
            # routers (and the controller, which imports this module to start them) serve no HTTP.
            from router.frontend.apis.app import HttpServer, build_app

            token = read_token(self.config.token_file) if self.config.token_file else None
            self._http = HttpServer(build_app(self._generation, self.metrics, token), self.config)
            await self._http.start()
        await self._server.set_serving(bool(self.directory.served_models()))
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_forever())
        self._events_task = asyncio.get_running_loop().create_task(self._follow_kv_events_forever())
        status = self._status()
        await self._controller.register_router.remote(status)
        return status

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace_s``, unregister."""
        for task in (self._refresh_task, self._events_task):
            if task is not None:
                task.cancel()
        if self._server is not None:
            await self._server.set_serving(False)
            await self._server.server.stop(grace_s)
        if self._http is not None:
            await self._http.stop(grace_s)
        self.channels.close()
        self._generation.tokenizers.close()
        await self._controller.unregister_router.remote(self.router_id)

    def _status(self) -> pb.RouterStatus:
        return pb.RouterStatus(
            router_id=self.router_id,
            grpc_address=f"{_advertised(self.config.host)}:{self._server.port}" if self._server else "",
            num_inflight=self._generation.num_inflight,
            metrics_url=self.metrics_url,
            http_url=self._http_url(),
        )

    def _http_url(self) -> str:
        """Where the OpenAI/KServe HTTP API listens ("" when ``http_port`` is None)."""
        if self._http is None or self._http.port is None:
            return ""
        scheme = "https" if self.config.tls is not None else "http"
        return f"{scheme}://{_advertised(self.config.host)}:{self._http.port}"

    async def _cluster_status(self) -> pb.ClusterStatus:
        await self._controller.register_router.remote(self._status())
        return await self._controller.cluster_status.remote()

    async def _refresh(self) -> None:
        self.directory.update(await self._controller.replicas.remote(known=list(self.directory.replicas)))
        self.channels.retain(self.directory.replicas)
        for replica in self.directory.healthy("decode", ""):
            self.channels.get(replica.replica_id, replica.handle)  # open ahead, so no request waits for it
        for replica in self.directory.replicas.values():
            self.policy.report(worker_load(replica))
            if replica.namespace is None:
                try:
                    replica.namespace = await replica.handle.kv_namespace.remote()
                except (RayActorError, ActorUnavailableError):
                    pass  # gone; the next refresh drops it
        for message in self.directory.refuse_mismatched_namespaces():
            logger.error("router %s: %s", self.router_id, message)
        if self._server is not None:
            await self._server.set_serving(bool(self.directory.served_models()))

    async def channel_stats(self) -> ChannelStats:
        """How many batches and events this router's worker channels carried."""
        return self.channels.stats()

    async def prefix_index_seq(self, worker_id: str) -> int:
        """The last KV event batch of ``worker_id`` this router applied (-1: not followed)."""
        return self.index.seq(worker_id) if worker_id in self.index.workers else -1

    async def prefix_index_view(self) -> dict[str, tuple[int, ...]]:
        """Per followed worker: the last KV event batch applied and its keys per tier (pool, CPU,
        Redis). Routers fed the same event stream report the same view."""
        return {w: (self.index.seq(w), *(self.index.num_keys(w, tier) for tier in Tier)) for w in self.index.workers}

    async def _follow_kv_events_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.kv_event_poll_interval_s)
            if not self._generation.cache_aware(len(self.directory.healthy("prefill", ""))):
                continue
            live = dict(self.directory.replicas)
            for worker_id in self.index.workers:
                if worker_id not in live:
                    self.index.remove_worker(worker_id)
            await asyncio.gather(*(self._pull_kv_events(r) for r in live.values()))

    async def _pull_kv_events(self, replica: Replica) -> None:
        worker_id = replica.replica_id
        try:
            if worker_id in self.index.workers:
                try:
                    for batch in await replica.handle.kv_events.remote(self.index.seq(worker_id)):
                        self.index.apply(batch)
                    return
                except (EventGap, RayTaskError) as e:
                    if isinstance(e, RayTaskError) and not isinstance(e.cause, EventGap):
                        raise
                    logger.info("router %s: KV event gap for %s (%s); taking a snapshot", self.router_id, worker_id, e)
            self.index.load_snapshot(await replica.handle.kv_snapshot.remote())
        except (RayActorError, ActorUnavailableError):
            pass  # the worker is gone; the next refresh drops it
        except Exception:  # never let one worker's trouble stop the follower
            logger.exception("router %s: following the KV events of %s failed", self.router_id, worker_id)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.worker_refresh_interval_s)
            try:
                await self._refresh()
            except (RayActorError, ActorUnavailableError) as e:
                # The controller is restarting or gone: keep serving the last known map.
                logger.warning("router %s: worker map refresh failed: %s", self.router_id, str(e).splitlines()[0])
