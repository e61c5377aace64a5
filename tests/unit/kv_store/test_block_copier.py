"""The copier behind TieredKVStore: chosen by the pool's device, and the ordering contract the GPU
tiers rely on, checked on CPU with FakeStreamCopier (copies that land only when waited for)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_store.block_copier import HostBlockCopier, block_copier
from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.events import KVEventLog, Tier
from kv_store.keys import KeyNamespace
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.tiered import TieredKVStore
from tests.unit.kv_store.fake_stream import POISON, FakeStreamCopier
from tests.unit.kv_store.test_tiers import BYTES, LAYOUT, _row


def _store(pool_blocks: int, cpu_blocks: int, redis: RedisTier | None = None) -> tuple[TieredKVStore, FakeStreamCopier]:
    pool = BlockPool(pool_blocks)
    buffer = torch.zeros((pool_blocks, BYTES), dtype=torch.uint8)
    cpu = CPUTier(cpu_blocks * BYTES, BYTES, pin_memory=False) if cpu_blocks else None
    copier = FakeStreamCopier(buffer, cpu.buffer if cpu is not None else None)
    return TieredKVStore(pool, buffer, KVEventLog("w"), cpu, redis, copier=copier), copier


def _fill(store: TieredKVStore, keys: list[int]) -> list[int]:
    """A step that computed ``keys``: fresh blocks (evicting what they held), written, cached, released."""
    ids = store.pool.allocate(len(keys))
    for block_id, key in zip(ids, keys):
        store.buffer[block_id] = _row(key)
        store.pool.cache(block_id, key)
    store.pool.release(reversed(ids))
    return ids


def _redis(redis_server) -> RedisTier:
    redis_server.client().flushall()
    return RedisTier(RedisTierConfig(redis_server.url, ttl_s=60), KeyNamespace("t", "f", "fp32", 2), LAYOUT)


def test_the_copier_follows_the_pool_device():
    pool = torch.zeros((3, BYTES), dtype=torch.uint8)
    assert type(block_copier(pool, torch.zeros((2, BYTES), dtype=torch.uint8))) is HostBlockCopier
    assert type(block_copier(pool)) is HostBlockCopier
    with pytest.raises(ValueError, match=r"pool: on meta; KV tiers copy blocks from cpu or cuda pools"):
        block_copier(torch.empty((3, BYTES), dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match=r"pool: expected uint8 \[num_blocks, block_bytes\], got torch.float32 \[3, 4\]"):
        block_copier(torch.zeros((3, 4)))
    with pytest.raises(ValueError, match=rf"slots: expected host uint8 \[num_slots, {BYTES}\], got torch.uint8 \[2, 7\] on cpu"):
        block_copier(pool, torch.zeros((2, 7), dtype=torch.uint8))


def test_the_host_copier_moves_whole_blocks_at_once():
    pool = torch.zeros((3, BYTES), dtype=torch.uint8)
    slots = torch.zeros((2, BYTES), dtype=torch.uint8)
    copier = block_copier(pool, slots)
    pool[1] = _row(7)
    copier.save(1, 0)
    assert torch.equal(slots[0], _row(7))
    copier.load(0, 2)
    copier.load_bytes(_row(9).numpy().tobytes(), 0)
    assert [int(pool[i][0]) for i in range(3)] == [9, 7, 7]
    assert copier.block_bytes(0) == bytes([9]) * BYTES
    copier.wait_slot(0), copier.fence(), copier.synchronize()  # nothing in flight: no-ops


def test_the_fake_stream_shows_a_slot_only_once_waited_for_and_refuses_its_reuse_before():
    pool = torch.zeros((2, BYTES), dtype=torch.uint8)
    slots = torch.zeros((2, BYTES), dtype=torch.uint8)
    copier = FakeStreamCopier(pool, slots)
    pool[0] = _row(5)
    copier.save(0, 1)
    copier.fence()  # the step may now overwrite block 0; the host still may not read slot 1
    pool[0] = _row(6)
    assert int(slots[1][0]) == POISON
    with pytest.raises(AssertionError, match="slot 1 reused before its copy was waited for"):
        copier.save(0, 1)
    copier.wait_slot(1)
    assert int(slots[1][0]) == 5


def test_a_spill_waits_for_the_slot_before_redis_reads_it_and_the_step_waits_for_every_copy(redis_server):
    redis = _redis(redis_server)
    store, copier = _store(pool_blocks=4, cpu_blocks=2, redis=redis)
    try:
        assert _fill(store, [10, 11, 12, 13]) == [0, 1, 2, 3]
        assert copier.log == []
        assert store.evict_pool() == 4  # free-queue order: 13 (block 3), 12, 11, 10
        assert copier.log == [
            ("wait_slot", 0), ("save", 3, 0), ("fence",),
            ("wait_slot", 1), ("save", 2, 1), ("fence",),
            ("wait_slot", 0), ("save", 1, 0), ("fence",),  # 13 leaves slot 0 for Redis: read after the wait
            ("wait_slot", 1), ("save", 0, 1), ("fence",),
        ]  # fmt: skip
        assert redis.flush()
        sets = store.key_sets()
        assert (sets[Tier.CPU], sets[Tier.REDIS]) == ({10, 11}, {12, 13})
        copier.log.clear()
        store.buffer.fill_(0)  # the pool's blocks were reused for something else
        ids = store.load([10, 11, 12, 13])  # blocks 3, 2, 1, 0 (the free queue's order)
        assert copier.log == [("load", 1, 3), ("load", 0, 2), ("load_bytes", 1), ("load_bytes", 0), ("fence",)]
        assert [int(store.buffer[i][0]) for i in ids] == [10, 11, 12, 13]  # 12 and 13 came back from Redis intact
        assert copier.num_queued == 0
    finally:
        store.close()


def test_without_a_cpu_tier_an_evicted_block_is_read_for_redis_after_every_copy_into_it(redis_server):
    redis = _redis(redis_server)
    store, copier = _store(pool_blocks=2, cpu_blocks=0, redis=redis)
    try:
        [block_id] = _fill(store, [4])
        store.evict_pool()
        assert copier.log == [("block_bytes", block_id)]
        assert redis.flush()
        store.buffer.fill_(0)
        [loaded] = store.load([4])
        assert int(store.buffer[loaded][0]) == 4 and copier.log[-1] == ("fence",)
    finally:
        store.close()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.lists(st.integers(0, 9), min_size=1, max_size=5)),
        st.tuples(st.just("evict"), st.none()),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, with_redis=st.booleans())
def test_deferred_copies_keep_every_byte_and_the_same_books_as_host_copies(redis_server, ops, with_redis):
    """The same operations through the host copier and the fake stream: the same key sets, the
    same events, and every block that comes back up holds the bytes that went down."""
    stores = []
    for make_copier in (HostBlockCopier, FakeStreamCopier):
        redis = _redis(redis_server) if with_redis else None
        pool = BlockPool(5)
        buffer = torch.zeros((5, BYTES), dtype=torch.uint8)
        cpu = CPUTier(2 * BYTES, BYTES, pin_memory=False)
        stores.append(TieredKVStore(pool, buffer, KVEventLog("w"), cpu, redis, copier=make_copier(buffer, cpu.buffer)))
        try:
            store = stores[-1]
            for op, arg in ops:
                if op == "run":
                    keys = [hash(tuple(arg[: i + 1])) & 0xFFFF for i in range(len(arg))]
                    hits = store.pool.match_prefix(keys)
                    store.pool.acquire(hits)
                    hits += store.load(keys[len(hits) :])
                    assert [int(store.buffer[b][0]) for b in hits] == [k % 256 for k in keys[: len(hits)]]
                    fresh = store.pool.allocate(len(keys) - len(hits)) or []
                    for block_id, key in zip(fresh, keys[len(hits) :]):
                        store.buffer[block_id] = _row(key)
                        store.pool.cache(block_id, key)
                    store.pool.release(reversed(hits + fresh))
                else:
                    store.evict_pool()
                assert getattr(store.copier, "num_queued", 0) == 0  # every operation ends with its copies fenced
                if redis is not None:
                    assert redis.flush()  # what the next lookup finds in Redis does not hang on its writer's timing
        finally:
            store.close()
    host, fake = stores
    assert fake.key_sets() == host.key_sets()
    assert _engine_thread_events(fake) == _engine_thread_events(host)


def _engine_thread_events(store: TieredKVStore) -> list[tuple]:
    """Every pool and CPU tier event key by key (Redis's come from its writer thread, in its own time)."""
    batch = store.events.flush()
    return [(e.kind, e.tier, key) for e in (batch.events if batch else ()) if e.tier is not Tier.REDIS for key in e.keys]
