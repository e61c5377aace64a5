"""The names of every Prometheus series the code exports, collected from its real metric
objects and collectors (never from a list written here), so a dashboard query that names a
series nobody exports fails its test.

Objects that are cheap to build are built and collected: the router's and the planner's
registries, the worker's engine, tier, TP-rank and request-timing collectors, the controller's
replica collector. The actors' own collectors (CountersCollector, KeyedCounterCollector) are made
inside actor __init__s that need Ray and a model, so their call sites are read from the source:
each one's name or prefix, and for a CountersCollector the stats dataclass its snapshot returns.
"""

from __future__ import annotations

import ast
import functools
import inspect
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

import decode_worker.actor
import engine.replica
import prefill_worker.actor
from decode_worker.request_plane import RequestPlaneStats
from engine.metrics import CountersCollector, EngineStatsCollector, RequestTimingHistograms, TierStatsCollector, TPRankCollector
from engine.outputs import EngineStats
from kv_store.redis_tier import RedisTierStats
from kv_store.tiered import TieredStats
from planner.live import PlannerMetrics
from router.control.cluster_map import ClusterMap, ReplicaCollector
from router.frontend.metrics import RouterMetrics

LABELS = {"replica": "r0", "pool": "decode"}
SNAPSHOTS = {
    (prefill_worker.actor, "self.transfer_stats_now"): prefill_worker.actor.PrefillStats,
    (decode_worker.actor, "self.transfer_stats_now"): decode_worker.actor.TransferStats,
    (decode_worker.actor, "lambda: self.request_plane_server.stats"): RequestPlaneStats,
}
"""What each CountersCollector call site's snapshot returns."""


def _sample_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples} | {
        family.name for family in registry.collect()}


def _built_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    engine_stats = EngineStats(*(0,) * 8)
    store = SimpleNamespace(stats=TieredStats(), redis=SimpleNamespace(stats_snapshot=RedisTierStats))
    registry.register(EngineStatsCollector(lambda: engine_stats, LABELS))
    registry.register(TierStatsCollector(store, LABELS))
    registry.register(TPRankCollector(lambda: [{"rank": 0, "alive": True, "param_bytes": 1}], LABELS))
    timings = RequestTimingHistograms(LABELS)
    timings.observe(0.1, 0.1, 0.1, 0.1)
    for collector in timings.collectors:
        registry.register(collector)
    registry.register(ReplicaCollector(ClusterMap()))
    return registry


def _call_sites(module) -> list[ast.Call]:
    tree = ast.parse(inspect.getsource(module))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("CountersCollector", "KeyedCounterCollector")]


def _source_collector_names() -> set[str]:
    names = set()
    for module in (engine.replica, prefill_worker.actor, decode_worker.actor):
        for call in _call_sites(module):
            name = ast.literal_eval(call.args[0])
            if call.func.id == "KeyedCounterCollector":
                names |= {name, f"{name}_total"}
                continue
            snapshot = ast.unparse(call.args[1])
            stats = SNAPSHOTS.get((module, snapshot))
            assert stats is not None, f"{module.__name__}: CountersCollector({name!r}, {snapshot}): add its stats class to SNAPSHOTS"
            registry = CollectorRegistry()
            registry.register(CountersCollector(name, stats, LABELS, frozenset()))
            names |= _sample_names(registry)
    return frozenset(names)


@functools.cache
def exported_metric_names() -> frozenset[str]:
    """Every series name a scrape of a router, worker, controller or planner can return
    (counters with their _total, histograms with _bucket/_sum/_count)."""
    names = _sample_names(RouterMetrics("r0").registry) | _sample_names(PlannerMetrics().registry)
    names |= _sample_names(_built_registry())
    names |= _source_collector_names()
    return frozenset(names)
