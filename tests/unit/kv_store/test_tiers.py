"""The CPU tier, KV events and the tiered store over a real BlockPool (and a real redis-server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.events import EventGap, EventKind, KeySets, KVEventLog, Tier
from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered import TieredKVStore

LAYOUT = KVBlockLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, kv_dtype="fp32")
BYTES = LAYOUT.block_bytes


def _row(value: int) -> torch.Tensor:
    return torch.full((BYTES,), value % 256, dtype=torch.uint8)


def test_cpu_tier_is_lru_and_hands_victims_to_on_evict():
    spilled = []
    tier = CPUTier(3 * BYTES, BYTES, on_evict=lambda k, b: spilled.append((k, int(b[0]))))
    for key in (1, 2, 3):
        assert tier.put(key, _row(key)) == []
    tier.get(1)  # 2 is now least recently used
    assert tier.put(4, _row(4)) == [2]
    assert spilled == [(2, 2)]
    assert sorted(tier.keys()) == [1, 3, 4] and int(tier.get(4)[0]) == 4
    with pytest.raises(ValueError, match="holds no block"):
        CPUTier(BYTES - 1, BYTES)


def test_event_log_numbers_batches_and_reports_gaps():
    log = KVEventLog("w", retain=2)
    log.record(EventKind.STORED, Tier.POOL, [1])
    log.record(EventKind.STORED, Tier.POOL, [2])  # merges with the previous event
    first = log.flush()
    assert (first.seq, first.events[0].keys) == (1, (1, 2))
    assert log.flush() is None
    log.record(EventKind.REMOVED, Tier.POOL, [1])
    log.flush()
    log.record(EventKind.CLEARED, Tier.POOL)
    log.flush()
    assert [b.seq for b in log.since(1)] == [2, 3]
    with pytest.raises(EventGap):
        log.since(0)  # batch 1 is no longer kept
    sets = KeySets("w")
    sets.apply(first)
    with pytest.raises(EventGap):
        sets.apply(log.since(2)[0])  # batch 3 after batch 1


def _store(pool_blocks=6, cpu_blocks=3, redis=None):
    pool = BlockPool(pool_blocks)
    buffer = torch.zeros((pool_blocks, BYTES), dtype=torch.uint8)
    cpu = CPUTier(cpu_blocks * BYTES, BYTES) if cpu_blocks else None
    return TieredKVStore(pool, buffer, KVEventLog("w"), cpu, redis)


def _fill(store, keys):
    """A request that computed ``keys``: fresh blocks, written, cached, released."""
    ids = store.pool.allocate(len(keys))
    for block_id, key in zip(ids, keys):
        store.buffer[block_id] = _row(key)
        store.pool.cache(block_id, key)
    store.pool.release(reversed(ids))


def test_evicted_blocks_spill_to_cpu_then_redis_and_load_back_up(redis_server):
    redis = RedisTier(RedisTierConfig(redis_server.url, ttl_s=60), KeyNamespace("t", "f", "fp32", 2), LAYOUT)
    store = _store(pool_blocks=4, cpu_blocks=2, redis=redis)
    _fill(store, [10, 11, 12, 13])
    # tail first (the order a sequence releases its blocks): 13, 12 reach the CPU tier, then
    # 11, 10 push them on to Redis; the prefix stays in the faster tier
    assert store.evict_pool() == 4
    assert redis.flush()
    sets = store.key_sets()
    assert (sets[Tier.POOL], sets[Tier.CPU], sets[Tier.REDIS]) == (set(), {10, 11}, {12, 13})
    ids = store.load([10, 11, 12, 13, 14])  # CPU for 10, 11, then Redis for 12, 13
    assert [int(store.buffer[i][0]) for i in ids] == [10, 11, 12, 13]
    assert store.pool.match_prefix([10, 11, 12, 13]) == ids
    t = store.stats.tiers
    assert (t[Tier.REDIS].num_hits, t[Tier.CPU].num_hits) == (2, 2)
    store.close()


def test_a_run_found_nowhere_loads_nothing_and_counts_a_miss():
    store = _store()
    _fill(store, [1, 2])
    store.evict_pool()
    assert store.load([5, 1]) == []
    assert store.stats.tiers[Tier.CPU].num_misses == 1
    assert store.pool.num_free_blocks == store.pool.num_blocks


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.lists(st.integers(0, 9), min_size=1, max_size=5)),
        st.tuples(st.just("evict"), st.none()),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, with_redis=st.booleans())
def test_event_replay_reproduces_every_tier_and_the_pool_never_leaks(redis_server, ops, with_redis):
    redis = None
    if with_redis:
        redis_server.client().flushall()
        redis = RedisTier(RedisTierConfig(redis_server.url, ttl_s=60), KeyNamespace("t", "f", "fp32", 2), LAYOUT)
    store = _store(pool_blocks=5, cpu_blocks=2, redis=redis)
    replica = KeySets.from_snapshot(store.snapshot())  # a consumer that joined at the start
    try:
        for op, arg in ops:
            if op == "run":
                # a request whose prompt blocks are the chain of keys ``arg`` (distinct per prefix)
                keys = [hash(tuple(arg[: i + 1])) & 0xFFFF for i in range(len(arg))]
                hits = store.pool.match_prefix(keys)
                store.pool.acquire(hits)
                hits += store.load(keys[len(hits):])
                for block_id, key in zip(hits, keys):
                    assert int(store.buffer[block_id][0]) == key % 256  # what came back is what was stored
                fresh = store.pool.allocate(len(keys) - len(hits)) or []
                for block_id, key in zip(fresh, keys[len(hits):]):
                    store.buffer[block_id] = _row(key)
                    store.pool.cache(block_id, key)
                store.pool.release(reversed(hits + fresh))
            elif op == "evict":
                store.evict_pool()
            else:
                store.pool.reset_prefix_cache()
            assert store.pool.num_free_blocks == store.pool.num_blocks
        if redis is not None:
            assert redis.flush()
        store.events.flush()
        for batch in store.events.since(replica.seq):
            replica.apply(batch)
        assert replica.keys == store.key_sets()
    finally:
        store.close()


def test_snapshot_plus_later_batches_equals_the_live_sets():
    store = _store(pool_blocks=4, cpu_blocks=2)
    _fill(store, [1, 2, 3])
    store.evict_pool()
    snapshot = store.snapshot()
    _fill(store, [7, 8])
    store.evict_pool()
    replica = KeySets.from_snapshot(snapshot)
    for batch in store.events.since(snapshot.seq):
        replica.apply(batch)
    store.events.flush()
    for batch in store.events.since(replica.seq):
        replica.apply(batch)
    assert replica.keys == store.key_sets()
    assert np.array_equal(sorted(replica.keys[Tier.CPU]), [7, 8])
