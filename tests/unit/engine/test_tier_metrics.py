"""The Redis tier's counters of a multi-rank replica are the replica's: every rank writes and reads
its own values, so the leader adds the other ranks' counters (from its last status probe)."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from engine.metrics import TierStatsCollector
from kv_store.redis_tier import RedisTierStats
from kv_store.tiered import TieredStats

LABELS = {"replica": "decode-0", "pool": "decode"}


def _exported(rank_redis) -> str:
    own = RedisTierStats(num_hits=3, num_puts=5, num_rejected=1)
    store = SimpleNamespace(stats=TieredStats(), redis=SimpleNamespace(stats_snapshot=lambda: own))
    registry = CollectorRegistry()
    registry.register(TierStatsCollector(store, LABELS, rank_redis))
    return generate_latest(registry).decode()


def test_the_other_ranks_redis_counters_are_added_to_the_leaders():
    ranks = [asdict(RedisTierStats(num_hits=2, num_puts=7, num_rejected=4)), asdict(RedisTierStats(num_puts=1))]
    text = _exported(lambda: ranks)
    assert 'splitserve_redis_tier_puts_total{pool="decode",replica="decode-0"} 13.0' in text
    assert 'splitserve_redis_tier_rejected_total{pool="decode",replica="decode-0"} 5.0' in text
    assert 'splitserve_redis_tier_hits_total{pool="decode",replica="decode-0"} 5.0' in text


def test_a_replica_of_one_rank_exports_its_own_counters():
    assert 'splitserve_redis_tier_puts_total{pool="decode",replica="decode-0"} 5.0' in _exported(list)
