"""The Redis tier's per-head values across the shards of a TP group, against a real redis-server:
any shard reads exactly its heads whoever wrote them, and a block is reported stored only once
every head of the model is in Redis."""

from __future__ import annotations

import numpy as np
import pytest

from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.redis_value import HEADER_BYTES, ValueRejected, decode_value, encode_value, head_value_bytes

NUM_HEADS = 3
# head_dim 3 and block_size 1: 6-byte fp8 heads, so the payload (18 bytes) is padded before the
# scales (at 24) -- the assembly must put each head's scales in the trailer, not after its payload
LAYOUTS = {
    "fp32": KVBlockLayout(num_layers=2, num_kv_heads=NUM_HEADS, head_dim=4, block_size=2, kv_dtype="fp32"),
    "bf16": KVBlockLayout(num_layers=2, num_kv_heads=NUM_HEADS, head_dim=4, block_size=2, kv_dtype="bf16"),
    "fp8_e4m3": KVBlockLayout(num_layers=1, num_kv_heads=NUM_HEADS, head_dim=3, block_size=1, kv_dtype="fp8_e4m3"),
}
FP8 = LAYOUTS["fp8_e4m3"]


@pytest.fixture
def raw(redis_server):
    client = redis_server.client()
    client.flushall()
    return client


def _namespace(layout):
    return KeyNamespace("tiny", "abc123", layout.kv_dtype, layout.block_size, tp_size=1)


def _sublayout(layout, num_heads):
    return KVBlockLayout(layout.num_layers, num_heads, layout.head_dim, layout.block_size, layout.kv_dtype)


def _blocks(layout, n, seed=0):
    """Blocks of ``layout`` with random heads and scales and zero padding (what get_prefix assembles)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(n):
        block = bytearray(layout.block_bytes)
        payload, scales = layout.head_ranges(0, layout.num_kv_heads)
        for r in (payload, scales):
            block[r.start : r.stop] = rng.integers(0, 256, len(r), dtype=np.uint8).tobytes()
        blocks.append(bytes(block))
    return blocks


def _shard(block, layout, head_start, num_heads):
    """The block a shard holding heads [head_start, head_start + num_heads) of ``layout`` has."""
    sub = _sublayout(layout, num_heads)
    out = bytearray(sub.block_bytes)
    payload, scales = layout.head_ranges(head_start, head_start + num_heads)
    out[: sub.payload_bytes] = block[payload.start : payload.stop]
    out[sub.scales_offset : sub.scales_offset + sub.scale_bytes] = block[scales.start : scales.stop]
    return bytes(out)


def _tier(redis_server, layout, head_start=0, num_heads=None, stored=None, **config):
    num_heads = layout.num_kv_heads if num_heads is None else num_heads
    return RedisTier(
        RedisTierConfig(redis_server.url, **({"ttl_s": 60, "socket_timeout_s": 1.0} | config)), _namespace(layout),
        _sublayout(layout, num_heads), None if stored is None else stored.extend,
        head_start=head_start, num_model_kv_heads=layout.num_kv_heads,
    )


@pytest.mark.parametrize("dtype", list(LAYOUTS))
def test_each_head_is_one_value_and_the_scales_travel_with_their_head(redis_server, raw, dtype):
    layout = LAYOUTS[dtype]
    tier = _tier(redis_server, layout)
    blocks = _blocks(layout, 2, seed=1)
    assert tier.put_many([(1, blocks[0]), (2, blocks[1])]) == [1, 2]
    one_head = _sublayout(layout, 1)
    for key, block in zip((1, 2), blocks):
        for head in range(NUM_HEADS):
            payload, scales = layout.head_ranges(head, head + 1)
            value = raw.get(tier.redis_key(key, head))
            assert len(value) == HEADER_BYTES + head_value_bytes(one_head)
            assert decode_value(value, key, head, _namespace(layout), layout).tobytes() == block[payload.start : payload.stop] + block[scales.start : scales.stop]
    assert len(raw.keys()) == 2 * NUM_HEADS
    assert [b.tobytes() for b in tier.get_prefix([1, 2, 3])] == blocks
    assert tier.count_prefix([1, 2, 3]) == 2
    tier.close()


@pytest.mark.parametrize("dtype", list(LAYOUTS))
def test_a_tp3_group_and_a_single_shard_write_the_same_values_and_read_each_others_blocks(redis_server, raw, dtype):
    layout = LAYOUTS[dtype]
    blocks = _blocks(layout, 3, seed=2)
    keys = [10, 11, 12]
    ranks = [_tier(redis_server, layout, head_start=h, num_heads=1) for h in range(NUM_HEADS)]
    whole = _tier(redis_server, layout)
    names = [whole.redis_key(k, h) for k in keys for h in range(NUM_HEADS)]

    for rank, tier in enumerate(ranks):
        assert tier.put_many([(k, _shard(b, layout, rank, 1)) for k, b in zip(keys, blocks)]) == keys
    assert all(tier.wait_confirmed(timeout_s=0) for tier in ranks)  # without an on_stored nothing waits
    by_ranks = raw.mget(names)
    assert [b.tobytes() for b in whole.get_prefix(keys)] == blocks

    raw.flushall()
    assert whole.put_many(list(zip(keys, blocks))) == keys
    assert raw.mget(names) == by_ranks  # byte for byte the same values
    for rank, tier in enumerate(ranks):
        assert [b.tobytes() for b in tier.get_prefix(keys)] == [_shard(b, layout, rank, 1) for b in blocks]
    tp2_rank_1 = _tier(redis_server, layout, head_start=1, num_heads=2)  # another split reads its heads too
    assert [b.tobytes() for b in tp2_rank_1.get_prefix(keys)] == [_shard(b, layout, 1, 2) for b in blocks]
    for tier in [*ranks, whole, tp2_rank_1]:
        tier.close()


def test_a_block_is_reported_stored_only_once_every_head_is_in_redis(redis_server, raw):
    stored = [[] for _ in range(NUM_HEADS)]
    ranks = [_tier(redis_server, FP8, head_start=h, num_heads=1, stored=stored[h]) for h in range(NUM_HEADS)]
    blocks = _blocks(FP8, 2, seed=3)
    keys = [20, 21]
    for rank in (0, 1):
        assert ranks[rank].put_many([(k, _shard(b, FP8, rank, 1)) for k, b in zip(keys, blocks)]) == keys
    assert stored == [[], [], []]  # head 2 is missing: nobody reports the blocks
    assert ranks[0].count_prefix(keys) == 0 and ranks[0].count_prefix(keys, range(0, 2)) == 2
    assert ranks[2].put_many([(k, _shard(b, FP8, 2, 1)) for k, b in zip(keys, blocks)]) == keys
    assert stored[2] == keys  # the last head in: confirmed by the write's own check
    assert ranks[0].wait_confirmed() and ranks[1].wait_confirmed()
    assert stored == [keys, keys, keys]
    assert ranks[0].count_prefix(keys) == 2
    for tier in ranks:
        assert tier.stats_snapshot().num_unconfirmed == 0
        tier.close()


def test_async_writes_of_a_tp3_group_are_each_confirmed(redis_server, raw):
    stored = [[] for _ in range(NUM_HEADS)]
    ranks = [_tier(redis_server, FP8, head_start=h, num_heads=1, stored=stored[h]) for h in range(NUM_HEADS)]
    blocks = _blocks(FP8, 5, seed=4)
    keys = list(range(30, 35))
    for rank, tier in enumerate(ranks):
        for k, b in zip(keys, blocks):
            assert tier.put_async(k, _shard(b, FP8, rank, 1))
    for tier in ranks:
        assert tier.flush() and tier.wait_confirmed()
    assert [sorted(s) for s in stored] == [keys, keys, keys]
    whole = _tier(redis_server, FP8)
    assert [b.tobytes() for b in whole.get_prefix(keys)] == blocks
    for tier in [*ranks, whole]:
        tier.close()


def test_a_missing_head_ends_the_run_at_its_block(redis_server, raw):
    tier = _tier(redis_server, FP8)
    blocks = _blocks(FP8, 4, seed=5)
    keys = [40, 41, 42, 43]
    tier.put_many(list(zip(keys, blocks)))
    raw.delete(tier.redis_key(42, 1))
    assert [b.tobytes() for b in tier.get_prefix(keys)] == blocks[:2]
    assert tier.count_prefix(keys) == 2
    assert tier.count_prefix(keys, range(2, 3)) == 4  # head 1 aside, block 42 is whole
    rank_2 = _tier(redis_server, FP8, head_start=2, num_heads=1)
    assert [b.tobytes() for b in rank_2.get_prefix(keys)] == [_shard(b, FP8, 2, 1) for b in blocks]
    stats = tier.stats_snapshot()
    assert (stats.num_hits, stats.num_misses, stats.num_rejected) == (2, 1, 0)
    with pytest.raises(ValueError, match="heads: range"):
        tier.count_prefix(keys, range(2, 4))
    tier.close()
    rank_2.close()


def test_foreign_values_under_a_heads_key_are_rejected_and_counted(redis_server, raw):
    rank_1 = _tier(redis_server, FP8, head_start=1, num_heads=1)
    blocks = _blocks(FP8, 2, seed=6)
    keys = [50, 51]
    rank_1.put_many([(k, _shard(b, FP8, 1, 1)) for k, b in zip(keys, blocks)])
    good = raw.get(rank_1.redis_key(51, 1))
    one_head = _sublayout(FP8, 1)
    bf16 = KVBlockLayout(1, 1, 3, 1, "bf16")
    foreign = {
        "checksum": good[:-1] + bytes([good[-1] ^ 0xFF]),
        "kv head": encode_value(51, 0, good[HEADER_BYTES:], _namespace(FP8), one_head),
        "namespace": encode_value(51, 1, good[HEADER_BYTES:], KeyNamespace("tiny", "other", "fp8_e4m3", 1), one_head),
        "kv dtype": encode_value(51, 1, bytes(head_value_bytes(bf16)), _namespace(FP8), bf16),
    }
    for reason, value in foreign.items():
        with pytest.raises(ValueRejected, match=f"^{reason}"):
            decode_value(value, 51, 1, _namespace(FP8), one_head)
        raw.set(rank_1.redis_key(51, 1), value)
        assert [b.tobytes() for b in rank_1.get_prefix(keys)] == [_shard(blocks[0], FP8, 1, 1)]
    stats = rank_1.stats_snapshot()
    assert (stats.num_rejected, stats.num_misses, stats.num_hits) == (4, 4, 4)
    rank_1.close()


def test_blocks_whose_other_heads_never_arrive_are_given_up_and_counted(redis_server, raw):
    stored = []
    rank_0 = _tier(redis_server, FP8, head_start=0, num_heads=1, stored=stored, confirm_timeout_s=0.2)
    blocks = _blocks(FP8, 3, seed=7)
    assert rank_0.put_many([(60, _shard(blocks[0], FP8, 0, 1)), (61, _shard(blocks[1], FP8, 0, 1))]) == [60, 61]
    assert rank_0.put_async(62, _shard(blocks[2], FP8, 0, 1)) and rank_0.flush()
    assert rank_0.wait_confirmed(timeout_s=30)  # a liveness bound: they are given up after 0.2 s
    assert stored == []
    stats = rank_0.stats_snapshot()
    assert (stats.num_puts, stats.num_unconfirmed) == (3, 3)
    assert [b.tobytes() for b in rank_0.get_prefix([60, 61, 62])] == [_shard(b, FP8, 0, 1) for b in blocks]  # written all the same
    rank_0.close()


def test_closing_gives_up_pending_blocks(redis_server, raw):
    stored = []
    rank_0 = _tier(redis_server, FP8, head_start=0, num_heads=1, stored=stored)
    assert rank_0.put_many([(70, _shard(_blocks(FP8, 1)[0], FP8, 0, 1))]) == [70]
    rank_0.close()
    assert stored == [] and rank_0.stats_snapshot().num_unconfirmed == 1


def test_a_shard_must_lie_within_the_models_heads(redis_server):
    with pytest.raises(ValueError, match=r"head_start: heads \[2, 4\) are not heads of a model with 3"):
        _tier(redis_server, FP8, head_start=2, num_heads=2)
