"""The controller's vocabulary: its name on Ray, the pools, its config and how a replica starts.

Kept apart from the controller actor so that configs, the CLI and the planner can import it
without the actor's machinery.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

POOLS = ("prefill", "decode")
ROUTER_CLASS = "router.replica:RouterReplica"
_REPLICA_NAME = re.compile(r"splitserve-(prefill|decode)-(\d+)")


def replica_actor_name(replica_id: str) -> str:
    """The Ray actor name (in ``NAMESPACE``) of worker replica or router ``replica_id``."""
    return f"splitserve-{replica_id}"


def parse_replica_name(actor_name: str) -> tuple[str, int] | None:
    """``(pool, index)`` of a worker replica's actor name (``splitserve-decode-3``); None for any other name."""
    match = _REPLICA_NAME.fullmatch(actor_name)
    return (match.group(1), int(match.group(2))) if match else None


class StaleGenerationError(RuntimeError):
    """An act asked of (or by) a controller whose generation is no longer the newest: a restarted
    controller has taken over, and only it changes replicas."""


@dataclass(frozen=True)
class ControllerConfig:
    """Health checking of worker replicas, and what sizes the pools."""

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
    drain_timeout_s: float = 300.0
    """How long a drain that a restarted controller starts itself (a scale-down cut short before
    its drains were recorded) waits for the replica's requests before removing it."""
    follow_nodes: bool = False
    """Size each pool by the Ray nodes (Kubernetes): one replica per slot of the pool's resource on
    each alive node, started when a node joins and forgotten when it goes; off, pools keep the
    sizes set_pool and scale_pool give them."""

    def __post_init__(self) -> None:
        if self.health_check_interval_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health_check_interval_s and health_check_timeout_s: must be > 0")
        if not 0 < self.restart_backoff_s <= self.max_restart_backoff_s:
            raise ValueError(f"restart_backoff_s: must be > 0 and <= max_restart_backoff_s, got {self.restart_backoff_s} / {self.max_restart_backoff_s}")
        if self.stable_after_s < 0:
            raise ValueError(f"stable_after_s: must be >= 0, got {self.stable_after_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
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
    """Processes of each pipeline stage of a replica (its tensor- or expert-parallel ranks): above 1,
    the stage is placed as a placement group of that many bundles on one node (router/control/placement.py)."""
    pp_size: int = 1
    """Pipeline stages of each replica: a replica is ``pp_size x tp_size`` ranks, one placement
    group per stage, the stages on one node or several."""
    num_layers: int = 0
    """The model's decoder layers, named when a pipelined replica cannot be placed; 0: not known."""
    rank_kind: str = "TP"
    """What the ranks split, for messages: "TP" (the model) or "EP" (its experts)."""
    tp_rank_cpus: float = 1.0
    """Logical CPUs each follower rank reserves."""
    tp_rank_gpus: float = 0.0
    """GPUs each rank reserves (the leader too); 0 on CPU."""
    placement_timeout_s: float = 120.0
    """How long a replica's placement group may wait for resources before its start fails."""

    @property
    def num_ranks(self) -> int:
        """Processes of one replica."""
        return self.pp_size * self.tp_size

    @property
    def shape(self) -> str:
        """The replica's shape for messages: "TP 3", "EP 2", "PP 2 x TP 3"."""
        return f"PP {self.pp_size} x {self.rank_kind} {self.tp_size}" if self.pp_size > 1 else f"{self.rank_kind} {self.tp_size}"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.pp_size < 1:
            raise ValueError(f"pp_size: must be >= 1, got {self.pp_size}")
        if self.pool not in POOLS:
            raise ValueError(f"pool: {self.pool!r} is not one of {POOLS}")
        if ":" not in self.actor_class:
            raise ValueError(f"actor_class: {self.actor_class!r} is not module:Class")


@dataclass(frozen=True)
class RouterSpec:
    """How to start one router replica; the controller keeps every router it started alive."""

    router_id: str
    """Its id, e.g. "router-0"; its actor is named ``splitserve-<router_id>``."""
    config: object
    """Its RouterConfig (ports included: a replacement listens where the dead router listened)."""
    actor_class: str = ROUTER_CLASS
    """``module:Class`` of the router actor."""
    node_id: str | None = None
    """The Ray node it runs on (the head's); None lets Ray choose."""

    def __post_init__(self) -> None:
        if not self.router_id:
            raise ValueError("router_id: must not be empty")
        if parse_replica_name(replica_actor_name(self.router_id)) is not None:
            raise ValueError(f"router_id: {self.router_id!r} is a worker replica's id")
        if ":" not in self.actor_class:
            raise ValueError(f"actor_class: {self.actor_class!r} is not module:Class")


HEAD_RESOURCE = "splitserve_head"
"""The custom Ray resource of the node that runs the controller (``splitserve head``, a local
``up``). The controller asks for a sliver of it instead of pinning a node id: a head pod that
comes back as a new Ray node gets the restarted controller, where a node id would leave it
pending on the node that is gone."""


def pool_resource(pool: str) -> str:
    """The custom Ray resource a node offers per replica slot of ``pool``."""
    return f"splitserve_{pool}"
