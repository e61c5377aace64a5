"""The cluster map the controller owns (replicas, pools, routers, KV endpoints) and its metrics.

Plain data: the controller (router/control/controller.py) changes it; the collector reads it at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proto import splitserve_pb2 as pb
from router.control.controller_config import POOLS, ReplicaSpec


@dataclass
class MapReplica:
    """A worker replica as the controller keeps it."""

    handle: object
    model: pb.ModelInfo
    status: pb.ReplicaStatus
    started_s: float
    """``time.monotonic`` when it joined the map."""
    failed_checks: int = 0
    placement_groups: tuple = ()
    """The placement groups of a multi-rank replica's ranks, one per pipeline stage (stage 0's
    holds the leader); removed with the replica."""
    draining: bool = False
    """Being removed: it takes no new request (routers see ``status.draining``) and is removed when idle."""
    node_id: str = ""
    """The Ray node it runs on (its leader's, for a replica of several ranks)."""


@dataclass
class PoolState:
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
class ClusterMap:
    """Replicas, pools, routers and KV endpoints: what the controller owns."""

    replicas: dict[str, MapReplica] = field(default_factory=dict)
    pools: dict[str, PoolState] = field(default_factory=lambda: {pool: PoolState() for pool in POOLS})
    routers: dict[str, pb.RouterStatus] = field(default_factory=dict)
    kv_endpoints: dict[str, tuple] = field(default_factory=dict)
    """Decode replica id -> its ranks' KV endpoints (transport metadata included), as the worker published them."""

    def members(self, pool: str) -> list[str]:
        """Ids of the replicas of ``pool`` in the map, oldest first."""
        return [rid for rid, r in self.replicas.items() if r.status.pool == pool]


class ReplicaCollector(Collector):
    """Replicas per pool and health, read from the cluster map at scrape time."""

    def __init__(self, state: ClusterMap) -> None:
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


class ControllerCollector(Collector):
    """The controller's own history: its generation, restarts and the routers it started again.
    ``read`` returns ``(ControllerHistory, num_router_restarts)`` at scrape time."""

    def __init__(self, read: Callable[[], tuple[object, int]]) -> None:
        self._read = read

    def collect(self):
        history, num_router_restarts = self._read()
        generation = GaugeMetricFamily("splitserve_controller_generation", "The controller's generation (one more at every start or restart).")
        generation.add_metric([], history.generation)
        restarts = CounterMetricFamily("splitserve_controller_restarts", "Times Ray restarted the controller after it died.")
        restarts.add_metric([], history.num_restarts)
        last = GaugeMetricFamily("splitserve_controller_last_restart_timestamp_seconds", "Unix time of the controller's last restart (0: never).")
        last.add_metric([], history.last_restart_unix_s)
        routers = CounterMetricFamily("splitserve_router_restarts", "Routers the controller started again after they died.")
        routers.add_metric([], num_router_restarts)
        yield from (generation, restarts, last, routers)
