"""The pieces of a data-parallel replica's KV tiers: the union of its ranks' events, the stores of
other ranks' pools (bookkeeping only), and the leader's wait for blocks another process writes to
Redis (a real redis-server). The ranks moving their blocks is tests/integration/test_ep_kv_tiers.py."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.data_parallel import DataParallelKVStore, EventUnion
from kv_store.events import EventKind, KeySets, KVEventLog, Tier
from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered import RedisKeys, TieredKVStore

LAYOUT = KVBlockLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2, kv_dtype="fp32")
BYTES = LAYOUT.block_bytes
NAMESPACE = KeyNamespace("t", "f", "fp32", 2)

EVENTS = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.sampled_from([EventKind.STORED, EventKind.REMOVED, EventKind.CLEARED]),
        st.sampled_from([Tier.POOL, Tier.CPU]),
        st.lists(st.integers(0, 6), max_size=4),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events=EVENTS)
def test_the_union_of_the_ranks_events_replays_to_the_union_of_their_key_sets(events):
    log = KVEventLog("w")
    union = EventUnion(log, 3)
    replica = KeySets.from_snapshot(log.snapshot({tier: () for tier in Tier}))
    held = [{tier: set() for tier in Tier} for _ in range(3)]  # what each rank's tiers hold
    for rank, kind, tier, keys in events:
        if kind is EventKind.STORED:
            keys = [k for k in keys if k not in held[rank][tier]]  # a tier reports a key it gains, once
            held[rank][tier].update(keys)
        elif kind is EventKind.REMOVED:
            keys = [k for k in keys if k in held[rank][tier]]
            held[rank][tier].difference_update(keys)
        else:
            held[rank][tier].clear()
        union.rank(rank).record(kind, tier, keys)
        for batch in log.since(replica.seq) if log.flush() else ():
            replica.apply(batch)
        for t in (Tier.POOL, Tier.CPU):
            assert set(replica.keys[t]) == set().union(*(h[t] for h in held))


def test_a_key_two_ranks_hold_is_removed_when_the_last_drops_it():
    log = KVEventLog("w")
    union = EventUnion(log, 2)
    union.rank(0).record(EventKind.STORED, Tier.POOL, [7])
    union.rank(1).record(EventKind.STORED, Tier.POOL, [7, 8])
    union.rank(0).record(EventKind.REMOVED, Tier.POOL, [7])
    union.rank(1).record(EventKind.CLEARED, Tier.POOL)
    [batch] = [log.flush()]
    assert [(e.kind, e.keys) for e in batch.events] == [(EventKind.STORED, (7, 8)), (EventKind.CLEARED, ())]
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\), got 2"):
        union.rank(2)


def _meta(num_blocks: int) -> torch.Tensor:
    return torch.empty((num_blocks, BYTES), dtype=torch.uint8, device="meta")


class RecordingMirror:
    """Records the moves the leader makes for another rank (a stand-in for the plan channel)."""

    def __init__(self, num_loaded: int | None = None) -> None:
        self.moves: list[tuple] = []
        self.num_loaded = num_loaded

    def save(self, block_id, slot):
        self.moves.append(("save", block_id, slot))

    def load(self, slot, block_id):
        self.moves.append(("load", slot, block_id))

    def spill_block(self, key, block_id):
        self.moves.append(("spill_block", key, block_id))

    def spill_slot(self, key, slot):
        self.moves.append(("spill_slot", key, slot))

    def load_redis(self, key, block_id):
        self.moves.append(("load_redis", key, block_id))

    def agree(self, num_loaded):
        return num_loaded if self.num_loaded is None else min(num_loaded, self.num_loaded)

    def flush(self, wait):
        pass


def test_another_ranks_store_keeps_bookkeeping_and_sends_every_move_to_its_rank():
    pool = BlockPool(4)
    cpu = CPUTier(2 * BYTES, BYTES, bytes_elsewhere=True)
    mirror = RecordingMirror(num_loaded=1)
    store = TieredKVStore(pool, _meta(4), KVEventLog("w"), cpu, mirror=mirror)
    ids = pool.allocate(3)
    for block_id, key in zip(ids, (10, 11, 12)):
        pool.cache(block_id, key)
    pool.release(reversed(ids))
    store.evict_pool()  # two of them into the two slots; the third pushes one out (no Redis: dropped)
    held = [key for key in (10, 11, 12) if key in cpu]
    assert len(held) == 2 and cpu.buffer.is_meta
    assert [m[0] for m in mirror.moves] == ["save", "save", "save"]  # rank 1 copies each into its own slot
    assert len(store.load(held)) == 1 and pool.cached_keys() == held[:1]  # the rank loaded one of the two: only it counts
    assert [m[0] for m in mirror.moves[-2:]] == ["load", "load"]
    assert store.stats.tiers[Tier.CPU].num_hits == 1 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="bytes live on another rank"):
        cpu.get(10)
    with pytest.raises(ValueError, match="moves its blocks through that rank's mirror"):
        TieredKVStore(BlockPool(4), _meta(4), KVEventLog("w"), CPUTier(2 * BYTES, BYTES, bytes_elsewhere=True))
    with pytest.raises(ValueError, match="both on meta, or neither"):
        TieredKVStore(BlockPool(4), torch.zeros((4, BYTES), dtype=torch.uint8), KVEventLog("w"), cpu)


def test_a_data_parallel_store_is_the_leaders_own_first_and_shares_one_view_of_redis():
    log = KVEventLog("w")
    union, keys = EventUnion(log, 2), RedisKeys(log)
    own = TieredKVStore(BlockPool(4), torch.zeros((4, BYTES), dtype=torch.uint8), union.rank(0), redis_keys=keys)
    other = TieredKVStore(BlockPool(4), _meta(4), union.rank(1), redis_keys=keys)
    store = DataParallelKVStore([own, other], log, keys, None)
    assert store.for_rank(1) is other
    with pytest.raises(ValueError, match="the leader's own pool's store comes first"):
        DataParallelKVStore([other, own], log, keys, None)
    with pytest.raises(ValueError, match="shares the replica's Redis tier"):
        DataParallelKVStore([own, TieredKVStore(BlockPool(4), _meta(4), union.rank(1))], log, keys, None)
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\), got 2"):
        store.for_rank(2)


def test_blocks_another_process_writes_are_reported_once_every_head_is_there(redis_server):
    redis_server.client().flushall()
    config = RedisTierConfig(redis_server.url, ttl_s=60, confirm_timeout_s=0.5)
    writer = RedisTier(config, NAMESPACE, LAYOUT)  # a rank: writes its blocks, confirms nothing
    stored: list[int] = []
    seen = threading.Event()
    watcher = RedisTier(config, NAMESPACE, LAYOUT, on_stored=lambda keys: (stored.extend(keys), seen.set()))
    try:
        watcher.expect([1, 2])
        writer.put_many([(1, bytes(BYTES))])  # 2 never comes
        assert seen.wait(5) and watcher.wait_confirmed(timeout_s=5)
        assert stored == [1]
        assert watcher.stats_snapshot().num_unconfirmed == 1  # 2 given up after confirm_timeout_s
        writer.put_many([(3, bytes(BYTES))])
        redis_server.client().delete(writer.redis_key(3, 1))  # one head of it gone: never whole
        watcher.expect([3])
        assert watcher.wait_confirmed(timeout_s=5) and stored == [1]
    finally:
        writer.close()
        watcher.close()
