"""The global prefix index and the routing policies, on hand-built event sequences."""

from __future__ import annotations

import pytest

from kv_store.events import EventGap, EventKind, KVEvent, KVEventBatch, KVEventLog, KVSnapshot, Tier
from router.routing.policy import POLICIES, PolicyConfig, RouteRequest, WorkerLoad, make_policy
from router.routing.prefix_index import UNKNOWN, CachedRun, PrefixIndex


def _batch(worker, seq, *events):
    return KVEventBatch(worker, seq, tuple(KVEvent(EventKind(k), Tier(t), tuple(keys)) for k, t, keys in events))


def test_longest_run_per_worker_split_by_tier():
    index = PrefixIndex()
    index.apply(_batch("a", 1, ("stored", "pool", [1, 2]), ("stored", "cpu", [3])))
    index.apply(_batch("b", 1, ("stored", "pool", [1]), ("stored", "pool", [3, 4])))  # 2 missing: run stops at 1
    index.apply(_batch("c", 1, ("stored", "redis", [1, 2, 3, 4])))  # the Redis tier is everyone's
    runs = index.match([1, 2, 3, 4, 5])
    assert runs["a"] == CachedRun(pool=2, cpu=1, redis=1)
    assert runs["b"] == CachedRun(pool=3, redis=1)  # k2 from Redis; k1, k3, k4 from its pool
    assert runs["c"] == CachedRun(redis=4)
    assert index.match([9, 1]) == {"a": CachedRun(), "b": CachedRun(), "c": CachedRun()}


def test_a_lookup_stops_at_the_first_missing_key_and_remember_finds_the_rest():
    index = PrefixIndex()
    held = list(range(100, 140))
    index.apply(_batch("x", 1, ("stored", "pool", held)))
    found = index.lookup([7, *held])  # 7 is new: no run reaches past it, so the 40 held keys are not looked for
    assert found.slots.tolist() == [-1] + [UNKNOWN] * 40
    assert index.match(found) == {"x": CachedRun()}
    index.remember("y", found, until_s=9.0)
    index.settle()  # it must find the held keys rather than place them twice
    assert index.match(held) == {"x": CachedRun(pool=40), "y": CachedRun(pool=40)}
    assert index.match([7, *held]) == {"x": CachedRun(), "y": CachedRun(pool=41)}


def test_pool_beats_cpu_beats_redis_for_one_key():
    index = PrefixIndex()
    index.apply(_batch("a", 1, ("stored", "redis", [1, 2, 3]), ("stored", "cpu", [1, 2]), ("stored", "pool", [1])))
    assert index.match([1, 2, 3])["a"] == CachedRun(pool=1, cpu=1, redis=1)


def test_removal_clear_gap_snapshot_and_worker_removal():
    index = PrefixIndex()
    index.apply(_batch("a", 1, ("stored", "pool", [1, 2, 3])))
    index.apply(_batch("a", 2, ("removed", "pool", [2])))
    assert index.match([1, 2, 3])["a"] == CachedRun(pool=1)
    index.apply(_batch("a", 2, ("stored", "pool", [2])))  # a batch seen before is ignored
    assert index.match([1, 2])["a"] == CachedRun(pool=1)
    with pytest.raises(EventGap):
        index.apply(_batch("a", 4, ("stored", "pool", [2])))
    index.load_snapshot(KVSnapshot("a", 4, {Tier.POOL: frozenset({1, 2}), Tier.CPU: frozenset({3})}))
    assert index.seq("a") == 4
    assert index.match([1, 2, 3])["a"] == CachedRun(pool=2, cpu=1)
    index.apply(_batch("a", 5, ("cleared", "pool", [])))
    assert index.match([1, 2, 3])["a"] == CachedRun()  # 1 is gone, so the run never starts
    index.apply(_batch("b", 1, ("stored", "pool", [1])))
    index.remove_worker("a")
    assert set(index.match([1])) == {"b"}
    index.apply(_batch("c", 1, ("stored", "pool", [1])))  # reuses a's bit without inheriting a's keys
    assert index.match([1, 2, 3]) == {"b": CachedRun(pool=1), "c": CachedRun(pool=1)}


def test_index_follows_a_real_event_log():
    log = KVEventLog("w")
    index = PrefixIndex()
    log.record(EventKind.STORED, Tier.POOL, [10, 11, 12])
    log.record(EventKind.REMOVED, Tier.POOL, [12])
    log.record(EventKind.STORED, Tier.CPU, [12])
    log.flush()
    for batch in log.since(index.seq("w") if "w" in index.workers else 0):
        index.apply(batch)
    assert index.match([10, 11, 12, 13])["w"] == CachedRun(pool=2, cpu=1)


def _request(keys, tokens=None, block=16):
    return RouteRequest("r", keys, tokens if tokens is not None else len(keys) * block + 5, block)


def _loads(**queued):
    return [WorkerLoad(w, queued_prefill_tokens=q) for w, q in queued.items()]


def test_requests_sharing_a_prefix_colocate_even_before_any_event():
    policy = make_policy("splitserve", PrefixIndex(), PolicyConfig(memory_s=5.0), clock=lambda: 0.0)
    first = policy.choose(_request([1, 2, 3, 4]), _loads(a=0, b=0, c=0)).prefill
    for i in range(3):  # a burst with the same new prefix: no event has arrived yet
        assert policy.choose(_request([1, 2, 3, 4, 100 + i]), _loads(a=0, b=0, c=0)).prefill == first


def test_the_cache_holder_wins_until_its_queue_outweighs_the_prefix():
    index = PrefixIndex()
    index.apply(_batch("a", 1, ("stored", "pool", list(range(1, 65)))))  # 64 blocks = 1024 tokens
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=0))
    request = _request(list(range(1, 65)))
    assert policy.choose(request, _loads(a=500, b=0)).prefill == "a"  # 500 queued < 1024 recomputed
    assert policy.choose(request, _loads(a=5000, b=0)).prefill == "b"  # an overloaded holder loses


def test_a_universal_shared_prefix_does_not_pin_traffic_to_one_worker():
    index = PrefixIndex()
    shared = list(range(1, 33))  # a 512-token system prompt every request starts with
    index.apply(_batch("a", 1, ("stored", "pool", shared)))
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=0))
    chosen = []
    for i in range(40):
        unique = [1000 * (i + 1) + j for j in range(8)]
        chosen.append(policy.choose(_request(shared + unique), _loads(a=0, b=0, c=0, d=0)).prefill)
        if chosen[-1] != "a":  # once another worker computed it, it holds the prefix too
            index.apply(_batch(chosen[-1], index.seq(chosen[-1]) + 1 if chosen[-1] in index.workers else 1, ("stored", "pool", shared)))
    counts = {w: chosen.count(w) for w in "abcd"}
    assert max(counts.values()) <= 40 * 0.4, counts  # spread, not all on the first holder


def test_conditional_disaggregation_sends_short_uncached_parts_to_the_decode_worker():
    index = PrefixIndex()
    index.apply(_batch("decode-0", 1, ("stored", "pool", [1, 2, 3])))
    policy = make_policy("splitserve", index, PolicyConfig(local_prefill_max_tokens=64))
    decode = [WorkerLoad("decode-0")]
    assert policy.choose(_request([1, 2, 3], tokens=3 * 16 + 20), _loads(p=0), decode).prefill is None
    long = policy.choose(_request([7, 8, 9, 10, 11], tokens=200), _loads(p=0), decode)
    assert (long.prefill, long.decode) == ("p", "decode-0")


def test_baselines():
    index = PrefixIndex()
    index.apply(_batch("a", 1, ("stored", "pool", [1, 2, 3, 4])))
    rr = make_policy("round_robin", index)
    assert [rr.choose(_request([1]), _loads(a=0, b=0)).prefill for _ in range(4)] == ["a", "b", "a", "b"]
    ll = make_policy("least_loaded", index)
    assert ll.choose(_request([1, 2, 3, 4]), _loads(a=10, b=5)).prefill == "b"
    sg = make_policy("sglang_cache_aware", index)
    loads = [WorkerLoad("a", num_queued_requests=3), WorkerLoad("b", num_queued_requests=1)]
    assert sg.choose(_request([1, 2, 3, 4]), loads).prefill == "a"  # match rate 4/4.3 > 0.3
    assert sg.choose(_request([9, 9, 9, 9]), loads).prefill == "b"  # no match: the smallest cache
    skewed = [WorkerLoad("a", num_queued_requests=200), WorkerLoad("b", num_queued_requests=10)]
    assert sg.choose(_request([1, 2, 3, 4]), skewed).prefill == "b"  # imbalance: shortest queue
    assert set(POLICIES) == {"splitserve", "round_robin", "least_loaded", "sglang_cache_aware"}
    with pytest.raises(ValueError, match="policy"):
        make_policy("random", index)
