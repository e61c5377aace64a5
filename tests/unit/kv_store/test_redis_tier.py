"""The Redis tier against a real redis-server on loopback: values, validation, backoff, auth, TLS
(one shard that holds every head; shards of a TP group: test_redis_tier_shards.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from kv_store.redis_value import HEADER_BYTES, ValueRejected, decode_value, encode_value, head_value_bytes
from tests.certs import make_pki
from tests.redis_server import RedisServer

LAYOUT = KVBlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="fp8_e4m3")
NS = KeyNamespace("tiny", "abc123", "fp8_e4m3", 4)


def _blocks(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8).tobytes() for _ in range(n)]


def _tier(url, **kwargs):
    return RedisTier(RedisTierConfig(url, **({"ttl_s": 60, "socket_timeout_s": 0.3, "max_backoff_s": 0.5} | kwargs)), NS, LAYOUT)


def test_value_round_trip_and_every_header_field_is_checked():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, head_value_bytes(LAYOUT), dtype=np.uint8).tobytes()
    assert head_value_bytes(LAYOUT) == 2 * 2 * 4 * 8 + 2 * 2 * 4  # one head's payload (fp8), then its f32 [layers, K/V] scales
    value = encode_value(7, 1, data, NS, LAYOUT)
    assert len(value) == HEADER_BYTES + 144
    assert value[:4] == b"SSKV" and value[4:6] == (2).to_bytes(2, "little") and value[26:28] == (1).to_bytes(2, "little")
    assert value[34:36] == (1).to_bytes(2, "little")  # the head's index among the model's heads
    assert decode_value(value, 7, 1, NS, LAYOUT).tobytes() == data
    cases = {
        "truncated": value[:HEADER_BYTES - 1],
        "payload": value[:-1],
        "checksum": value[:-1] + bytes([value[-1] ^ 1]),
        "magic": b"XXXX" + value[4:],
        "value version": value[:4] + (1).to_bytes(2, "little") + value[6:],
        "key-spec version": value[:6] + (1).to_bytes(2, "little") + value[8:],
        "namespace": encode_value(7, 1, data, KeyNamespace("tiny", "other-weights", "fp8_e4m3", 4), LAYOUT),
        "block key": encode_value(8, 1, data, NS, LAYOUT),
        "kv head": encode_value(7, 0, data, NS, LAYOUT),
        "shape": encode_value(7, 1, data[:72] + data[128:136], NS, KVBlockLayout(2, 1, 4, 4, "fp8_e4m3")),
    }
    for reason, bad in cases.items():
        with pytest.raises(ValueRejected, match=f"^{reason if reason != 'payload' else 'truncated'}"):
            decode_value(bad, 7, 1, NS, LAYOUT)
    with pytest.raises(ValueRejected, match="^kv dtype"):
        decode_value(value, 7, 1, NS, KVBlockLayout(2, 2, 8, 4, "bf16"))
    with pytest.raises(ValueError, match="head 1: 143 bytes, the layout's heads have 144"):
        encode_value(7, 1, data[:-1], NS, LAYOUT)


def test_put_get_longest_run_with_ttl(redis_server):
    tier = _tier(redis_server.url)
    blocks = _blocks(4)
    assert tier.put_many(list(zip([1, 2, 3, 5], blocks))) == [1, 2, 3, 5]
    got = tier.get_prefix([1, 2, 3, 4, 5])
    assert [b.tobytes() for b in got] == blocks[:3]  # the run stops at the first missing key
    stats = tier.stats_snapshot()
    assert (stats.num_hits, stats.num_misses, stats.num_puts) == (3, 1, 4)
    raw = redis_server.client()
    assert all(0 < raw.ttl(tier.redis_key(key, head)) <= 60 for key in (1, 2, 3, 5) for head in (0, 1))
    assert tier.redis_key(1, 1) == f"splitserve:kv:{NS.fingerprint:016x}:0000000000000001:1"
    tier.close()


def test_async_puts_land_and_report_their_keys(redis_server):
    tier = _tier(redis_server.url)
    stored = []
    tier.on_stored = stored.extend
    blocks = _blocks(10, seed=1)
    for i, b in enumerate(blocks):
        assert tier.put_async(100 + i, b)
    assert tier.flush()
    assert sorted(stored) == list(range(100, 110))
    assert [b.tobytes() for b in tier.get_prefix(list(range(100, 110)))] == blocks
    tier.close()


def test_corrupt_truncated_and_foreign_values_are_counted_misses(redis_server):
    tier = _tier(redis_server.url)
    [a, b, c] = _blocks(3, seed=2)
    tier.put_many([(11, a), (12, b), (13, c)])
    raw = redis_server.client()
    good, head_0, block_11 = raw.get(tier.redis_key(12, 1)), raw.get(tier.redis_key(12, 0)), raw.get(tier.redis_key(11, 1))
    bf16 = KVBlockLayout(2, 2, 8, 4, "bf16")
    bad_values = {
        "truncated": good[:-10],
        "checksum": good[:-1] + bytes([good[-1] ^ 1]),
        "namespace": encode_value(12, 1, good[HEADER_BYTES:], KeyNamespace("tiny", "zzz", "fp8_e4m3", 4), LAYOUT),
        "kv head": head_0,
        "block key": block_11,
        "kv dtype": encode_value(12, 1, bytes(head_value_bytes(bf16)), NS, bf16),
    }
    for reason, bad in bad_values.items():
        raw.set(tier.redis_key(12, 1), bad)
        with pytest.raises(ValueRejected, match=f"^{reason}"):
            decode_value(bad, 12, 1, NS, LAYOUT)
        assert [x.tobytes() for x in tier.get_prefix([11, 12, 13])] == [a]
        assert tier.count_prefix([11, 12, 13]) == 3  # EXISTS: present, not validated
    stats = tier.stats_snapshot()
    assert (stats.num_rejected, stats.num_misses, stats.num_hits) == (6, 6, 6)
    tier.close()


def test_redis_down_is_skipped_for_the_backoff_after_one_failed_call(tmp_path):
    redis_server = RedisServer(tmp_path).start()
    tier = _tier(redis_server.url, min_backoff_s=60.0, max_backoff_s=60.0)
    [a] = _blocks(1, seed=3)
    tier.put_many([(1, a)])
    redis_server.stop()
    assert tier.get_prefix([1]) == []  # fails, no exception
    assert not tier.available
    assert tier.put_many([(2, a)]) == [] and tier.get_prefix([1]) == [] and tier.count_prefix([1]) == 0  # not even tried
    stats = tier.stats_snapshot()
    assert (stats.num_errors, stats.num_skipped, stats.num_dropped_puts) == (1, 3, 1)
    tier.close()


def test_a_redis_that_comes_back_is_used_again(tmp_path):
    redis_server = RedisServer(tmp_path).start()
    tier = _tier(redis_server.url)
    [a] = _blocks(1, seed=3)
    redis_server.stop()
    assert tier.get_prefix([1]) == [] and tier.stats_snapshot().num_errors == 1
    redis_server.start()  # same port, empty
    deadline = time.monotonic() + 30  # a liveness bound: the backoff is at most 0.5 s
    while not tier.put_many([(3, a)]):
        assert time.monotonic() < deadline, "the tier never came back"
        time.sleep(0.05)
    assert [x.tobytes() for x in tier.get_prefix([3])] == [a]
    tier.close()
    redis_server.stop()


def test_password_is_required_and_used(tmp_path):
    redis_server = RedisServer(tmp_path, password="s3cret").start()
    try:
        [a] = _blocks(1, seed=4)
        wrong = _tier(redis_server.url.replace("s3cret", "wrong"))
        assert wrong.put_many([(1, a)]) == []  # refused: skipped, not raised
        wrong.close()
        right = _tier(redis_server.url)
        assert right.put_many([(1, a)]) == [1]
        assert [x.tobytes() for x in right.get_prefix([1])] == [a]
        right.close()
    finally:
        redis_server.stop()


def test_rediss_tls(tmp_path):
    pki = make_pki(tmp_path / "pki")
    redis_server = RedisServer(tmp_path, tls=(pki.server_cert, pki.server_key, pki.ca_cert)).start()
    try:
        [a] = _blocks(1, seed=5)
        tier = _tier(redis_server.url, tls_ca_file=pki.ca_cert)
        assert tier.put_many([(1, a)]) == [1]
        assert [x.tobytes() for x in tier.get_prefix([1])] == [a]
        tier.close()
        untrusting = _tier(redis_server.url, tls_ca_file=pki.other_ca_cert)
        assert untrusting.get_prefix([1]) == [] and untrusting.stats_snapshot().num_errors == 1
        untrusting.close()
    finally:
        redis_server.stop()
