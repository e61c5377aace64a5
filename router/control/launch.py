"""Start a splitserve cluster on Ray: the controller, worker replicas and the routers.

This is the composition root: the one place outside the workers that names worker code, and
only by import path (``decode_worker.actor:DecodeWorker``, ``prefill_worker.actor:PrefillWorker``)
and config dataclass.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from prefill_worker.config import PrefillWorkerConfig
from proto import splitserve_pb2 as pb
from proto.tls import ClusterTLSConfig, ray_tls_env
from router.config import RouterConfig
from router.control import placement
from router.control.controller import CONTROLLER_NAME, NAMESPACE, POOLS, ClusterController, ControllerConfig, ReplicaSpec, RouterSpec, pool_resource
from router.control.controller_config import HEAD_RESOURCE, parse_replica_name
from router.replica import RouterReplica

DECODE_WORKER_CLASS = "decode_worker.actor:DecodeWorker"
PREFILL_WORKER_CLASS = "prefill_worker.actor:PrefillWorker"
_LOCAL_MIN_CPUS = 16
_STOP_TIMEOUT_S = 300.0
"""How long ``Cluster.stop`` waits for the controller to stop everything (a controller that cannot
be scheduled again would never answer) before killing the leftover actors itself."""
_LOCAL_POOL_SLOTS = 64
"""Replica slots per pool that a local single-node cluster offers (logical, not CPUs)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """A whole cluster: what each part runs with and how many replicas each pool has."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    prefill: PrefillWorkerConfig = field(default_factory=PrefillWorkerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    num_decode: int = 1
    """Decode replicas to start (0 when ``controller.follow_nodes`` sizes the pools)."""
    num_prefill: int = 0
    """Prefill replicas to start; 0 runs aggregated (decode replicas prefill their own requests)."""
    num_routers: int = 1
    """Router replicas: router-i listens on ``router.port + i`` (and metrics/HTTP ports + i) unless
    a port is 0 (a free one each). Each follows every worker's KV events itself, so their prefix
    indexes hold the same blocks and they route the same request alike."""
    ray_address: str | None = None
    """Join this Ray cluster; None starts a local one on 127.0.0.1."""
    decode_worker_class: str = DECODE_WORKER_CLASS
    """``module:Class`` of the decode replicas: ``DecodeWorker`` or a subclass of it (a bench's)."""
    prefill_tp_size: int | None = None
    """Tensor-parallel ranks of each prefill replica; None takes ``engine.tp_size``."""
    decode_tp_size: int | None = None
    """Tensor-parallel ranks of each decode replica; None takes ``engine.tp_size``."""
    decode_ep_size: int | None = None
    """Expert-parallel ranks of each decode replica (MoE models); None takes ``engine.ep_size``.
    Prefill replicas never run expert-parallel."""
    prefill_pp_size: int | None = None
    """Pipeline stages of each prefill replica (TP inside each stage); None takes ``engine.pp_size``."""
    decode_pp_size: int | None = None
    """Pipeline stages of each decode replica (TP inside each stage); None takes ``engine.pp_size``."""
    num_layers: int = 0
    """The model's decoder layers, named when a pipelined replica cannot be placed (the CLI reads
    them at start-up); 0: not known, not named."""

    def pool_engine(self, pool: str) -> EngineConfig:
        """The engine config of ``pool``'s replicas: ``engine`` with the pool's TP and PP (and, for decode, EP) size.

        Prefill replicas never speculate: they compute a prompt's KV and its first token, and the
        decode replica that takes the hand-off drafts and verifies. So a speculative decode pool
        runs beside a tensor-parallel prefill pool (speculation itself needs one-rank replicas)."""
        if pool == "prefill":
            return replace(
                self.engine, tp_size=self.prefill_tp_size or self.engine.tp_size, pp_size=self.prefill_pp_size or self.engine.pp_size,
                ep_size=1, speculative="off", draft_model=None,
            )
        return replace(
            self.engine, tp_size=self.decode_tp_size or self.engine.tp_size, pp_size=self.decode_pp_size or self.engine.pp_size,
            ep_size=self.decode_ep_size or self.engine.ep_size,
        )

    def router_config(self, index: int) -> RouterConfig:
        """Router ``index``'s config: ``router`` with each fixed port moved up by ``index``."""
        shifted = {name: getattr(self.router, name) + index for name in ("port", "metrics_port", "http_port") if getattr(self.router, name)}
        return replace(self.router, **shifted)

    def replica_spec(self, pool: str) -> ReplicaSpec:
        """How the controller starts ``pool``'s replicas."""
        engine = self.pool_engine(pool)
        worker = self.prefill if pool == "prefill" else self.worker
        actor_class = PREFILL_WORKER_CLASS if pool == "prefill" else self.decode_worker_class
        kind = "EP" if engine.ep_size > 1 else "TP"
        rank_gpus = 0.0 if engine.device == "cpu" else 1.0  # one GPU per rank on CUDA
        return ReplicaSpec(
            pool, actor_class, (engine, worker), tp_size=engine.num_ranks // engine.pp_size, pp_size=engine.pp_size, num_layers=self.num_layers,
            rank_kind=kind, tp_rank_cpus=worker.tp_rank_cpus, tp_rank_gpus=rank_gpus,
        )

    def __post_init__(self) -> None:
        for name in ("prefill_tp_size", "decode_tp_size", "decode_ep_size", "prefill_pp_size", "decode_pp_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for pool in POOLS:
            self.pool_engine(pool)  # validates the TP size against the tiers
        if self.controller.follow_nodes and (self.num_decode or self.num_prefill):
            raise ValueError(
                f"num_decode, num_prefill: must be 0 when controller.follow_nodes sizes the pools, got {self.num_decode}, {self.num_prefill}"
            )
        if self.num_routers < (0 if self.controller.follow_nodes else 1):
            raise ValueError(
                f"num_routers: must be >= 1, got {self.num_routers} (0 only where the controller follows the nodes and routers join as `splitserve router` nodes)"
            )
        if self.num_decode < 1 and not self.controller.follow_nodes:
            raise ValueError(f"num_decode: must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill: must be >= 0, got {self.num_prefill}")
        if self.num_prefill and self.worker.kv_transport == "none":
            raise ValueError("num_prefill: prefill replicas need decode replicas with a kv_transport, got 'none'")
        if (self.worker.cluster_tls is None) != (self.router.cluster_tls is None):
            raise ValueError("worker.cluster_tls: set it together with router.cluster_tls (the request plane is TLS at both ends or neither)")


def init_ray(address: str | None, cluster_tls: ClusterTLSConfig | None = None) -> None:
    """Join ``address``, or start a local Ray that stays on loopback, with the pool resources.

    With ``cluster_tls``, Ray's own gRPC (control calls, KV events) runs mutual TLS with it. Ray
    reads that from the environment once, when a process imports it, so this process must have
    been started with ``proto.tls.ray_tls_env(cluster_tls)`` (``splitserve up`` restarts itself
    with it); the Ray processes of a local cluster inherit it. Joining a cluster needs the same
    variables on every node, set before ``ray start``. Raises ValueError when they are missing.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts worker processes at nice 15 so its own daemons win the CPU. Our workers *are*
    # the serving path: at nice 15 the engine's OpenMP team lost the cores to every client,
    # raylet and GCS wake-up on a small machine. Workers of a local cluster run at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # A local Ray's GCS must write its port within 30 s by default. On a 2-core machine whose cores
    # other Ray nodes are busy starting (a test module with three nodes of its own beside this one,
    # and a core kept busy), it did not, and every test of that pytest worker errored at start-up.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    ray_env = ray_tls_env(cluster_tls) if cluster_tls is not None else {}
    missing = " ".join(f"{k}={v}" for k, v in ray_env.items() if os.environ.get(k) != v)
    if ray.is_initialized():
        if missing:
            logger.warning("cluster_tls: Ray was already started by this process; its own traffic uses TLS only if it had %s", missing)
        return
    if missing:
        raise ValueError(f"cluster_tls: Ray reads its TLS settings when a process imports it; start this process with {missing}")
    if address is not None:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return
    local = dict(
        # "local": a new Ray even where another runs on this host. With no address, ray.init joins
        # the last cluster a `ray start` on the host wrote to /tmp/ray/ray_current_cluster (a
        # `splitserve head` there, another test's node), and then refuses these resources.
        address="local",
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
        # Logical CPUs are scheduling tokens: on one machine every replica shares the same cores
        # anyway, so a local cluster admits more replicas than it has cores (2 cores, 1 + 2 replicas).
        num_cpus=max(os.cpu_count() or 1, _LOCAL_MIN_CPUS),
        resources={**{pool_resource(p): _LOCAL_POOL_SLOTS for p in POOLS}, HEAD_RESOURCE: 1},
    )
    try:
        ray.init(**local)
    except RuntimeError as error:
        # Twice in some hundreds of local starts on a loaded 2-core machine, the GCS process left no
        # log and no port file, and Ray waited the full 120 s for it. A second start, in a new
        # session directory, is what a person would do; any other failure is raised as it is.
        if "Timed out waiting for file" not in str(error):
            raise
        logger.warning("ray.init: %s; starting a local Ray again", error)
        ray.shutdown()
        ray.init(**local)


def _controller_placement() -> dict:
    """Where the controller runs: on the node offering ``HEAD_RESOURCE`` (a ``splitserve head``
    or a local ``up``), wherever that node is after a restart; on this process's node in a Ray
    cluster started otherwise."""
    if any(node["Alive"] and node["Resources"].get(HEAD_RESOURCE) for node in ray.nodes()):
        return {"resources": {HEAD_RESOURCE: 0.01}}
    return {"scheduling_strategy": _this_node()}


def _this_node() -> NodeAffinitySchedulingStrategy:
    """Pin an actor to the Ray node of this process: the controller and the routers need no CPU,
    so Ray could put them anywhere, and a worker node (a pod that scales away) is the wrong place."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class Cluster:
    """Handles on a running cluster's controller and routers; ``stop`` tears down what it started.

    The controller, the replicas and the routers are detached actors: the controller restarts
    when it dies (Ray starts it again and it rebuilds its map), and it keeps the replicas and
    routers alive. Detached actors outlive this process, so ``stop`` must run (``splitserve up``
    runs it on exit)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.controller = None
        self.routers: list = []
        """RouterReplica handles, router-0 first."""
        self.router_statuses: list[pb.RouterStatus] = []

    @property
    def router(self):
        """router-0's handle (None before ``start``)."""
        return self.routers[0] if self.routers else None

    @property
    def router_status(self) -> pb.RouterStatus | None:
        """router-0's status (None before ``start``)."""
        return self.router_statuses[0] if self.router_statuses else None

    def start(self) -> pb.RouterStatus:
        """Start the controller and the routers on this process's Ray node, and the replicas:
        ``num_decode`` / ``num_prefill`` of them, started before this returns, or, when the
        controller follows the nodes, one per slot of the nodes that have joined, in the background."""
        init_ray(self.config.ray_address, self.config.router.cluster_tls)
        self.controller = (
            ray.remote(ClusterController)
            .options(
                name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000, lifetime="detached", max_restarts=-1,
                **_controller_placement(),
            )
            .remote(self.config.controller)
        )
        decode, prefill = self.config.replica_spec("decode"), self.config.replica_spec("prefill")
        if self.config.controller.follow_nodes:
            ray.get(self.controller.follow_nodes.remote([decode, prefill]))
        else:
            ray.get([self.controller.set_pool.remote(decode, self.config.num_decode), self.controller.set_pool.remote(prefill, self.config.num_prefill)])
        node_id = ray.get_runtime_context().get_node_id()
        specs = [RouterSpec(f"router-{i}", self.config.router_config(i), node_id=node_id) for i in range(self.config.num_routers)]
        self.router_statuses = ray.get(self.controller.set_routers.remote(specs))
        self.routers = [self.router_handle(spec.router_id) for spec in specs]
        return self.router_status

    @staticmethod
    def router_handle(router_id: str):
        """The live actor of router ``router_id`` (after a replacement, the new one's)."""
        return ray.get_actor(f"splitserve-{router_id}", namespace=NAMESPACE)

    @staticmethod
    def start_router(router_id: str, config: RouterConfig):
        """A RouterReplica actor on this process's Ray node (not yet started: call ``start`` on it)."""
        return (
            ray.remote(RouterReplica)
            .options(name=f"splitserve-{router_id}", namespace=NAMESPACE, num_cpus=0, max_concurrency=10_000, scheduling_strategy=_this_node())
            .remote(router_id, config)
        )

    def stop(self) -> None:
        """Stop the routers and every replica (the controller does), then the controller; a
        replica, router or placement group left behind by a controller that could not finish is
        removed here."""
        router_names = {f"splitserve-router-{i}" for i in range(self.config.num_routers)}
        self.routers, self.router_statuses = [], []
        if self.controller is None:
            return
        try:
            ray.get(self.controller.shutdown.remote(), timeout=_STOP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            logger.warning("cluster: the controller did not stop within %.0f s; killing what it leaves", _STOP_TIMEOUT_S)
        finally:
            ray.kill(self.controller)  # no_restart: this time it stays down
            self.controller = None
            for actor in ray.util.list_named_actors(all_namespaces=True):
                name = actor["name"]
                if actor["namespace"] == NAMESPACE and (parse_replica_name(name) is not None or name in router_names):
                    logger.warning("cluster: %s outlived its controller; killing it", name)
                    try:
                        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
                    except ValueError:
                        pass  # gone meanwhile
            for name, group in placement.live_group_names().items():
                if parse_replica_name(placement.replica_of_group(name)) is not None:
                    logger.warning("cluster: placement group %s outlived its controller; removing it", name)
                    placement.release(group)
