"""KV tiers of tensor-parallel replicas: every rank spills and reloads its own slice of each
block (its KV heads) to its own CPU tier and to Redis, one value per KV head; a replica of
another TP size reads the same values by head. Real follower ranks (Ray actors joined by gloo),
a real redis-server, a tiny random llama with 3 KV heads at TP 3 (one per rank, as SmolLM2's),
fp32 KV: a prefix that came back from a tier gives the tokens of recomputing it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.params import SamplingParams
from kv_store.events import KeySets, Tier
from kv_store.keys import block_keys
from tests.integration.parallel_engines import parallel_engines, wait_in_redis
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FOLLOWER_CPUS = 0.5
PROMPT_BLOCKS = 4


@pytest.fixture(scope="module")
def engines(follower_hosts):
    with parallel_engines(FOLLOWER_CPUS, "test-tp-tiers", follower_hosts) as e:
        yield e


@pytest.fixture(scope="module")
def kv3(tiny_checkpoint):
    base = EngineConfig(model=str(tiny_checkpoint("llama-kv3")), kv_dtype="fp32", num_kv_blocks=32, max_num_batched_tokens=48)
    return lambda **overrides: replace(base, **overrides)


@pytest.fixture(scope="module")
def recomputed(engines, kv3):
    """The greedy tokens of a prompt computed from scratch, at TP 1 without any cache."""
    engine = engines.get(kv3(enable_prefix_caching=False))
    return lambda prompt: engine.generate([prompt], GREEDY)[0].output_token_ids


def _run(engine, prompt):
    [out] = engine.generate([prompt], GREEDY)
    return out


def _wait_in_redis(engine, prompt) -> None:
    wait_in_redis(engine, set(block_keys(prompt, 16, engine.namespace.root_key(None))[:PROMPT_BLOCKS]))


def test_tp3_prefix_back_from_each_rank_cpu_tier_equals_recompute(engines, kv3, recomputed):
    [prompt] = random_prompts([PROMPT_BLOCKS * 16 + 6], seed=61)
    engine = engines.get(kv3(tp_size=3, cpu_kv_cache_bytes=1 << 20))
    moves_before = [info["num_tier_moves"] for info in engines.follower_infos()]
    first = _run(engine, prompt)
    assert engine.offload_prefix_cache() >= PROMPT_BLOCKS
    assert engine.pool.num_cached_blocks == 0
    again = _run(engine, prompt)
    assert again.num_cached_tokens == PROMPT_BLOCKS * 16
    assert engine.kv_store.stats.tiers[Tier.CPU].num_hits >= PROMPT_BLOCKS
    assert again.output_token_ids == first.output_token_ids == recomputed(prompt)
    moves_after = [info["num_tier_moves"] for info in engines.follower_infos()]
    assert all(after >= before + 2 * PROMPT_BLOCKS for before, after in zip(moves_before, moves_after))  # each saved and loaded its slices


def test_tp3_prefix_back_from_redis_equals_recompute_and_tp1_reads_its_slices(engines, kv3, redis_server, recomputed):
    redis_server.client().flushall()
    [prompt] = random_prompts([PROMPT_BLOCKS * 16 + 3], seed=62)
    tp3 = engines.get(kv3(tp_size=3, redis_url=redis_server.url))
    first = _run(tp3, prompt)
    tp3.offload_prefix_cache()
    _wait_in_redis(tp3, prompt)
    heads = {key.rsplit(b":", 1)[1] for key in redis_server.client().keys(b"*")}
    assert heads == {b"0", b"1", b"2"}  # one value per KV head, each written by the rank holding it
    assert all(info["redis_stats"]["num_puts"] >= PROMPT_BLOCKS for info in engines.follower_infos())  # counted where written (metrics add them up)
    again = _run(tp3, prompt)
    assert again.num_cached_tokens == PROMPT_BLOCKS * 16
    assert again.output_token_ids == first.output_token_ids == recomputed(prompt)
    tp1 = engines.get(kv3(redis_url=redis_server.url))  # another TP size: the same keys, every head
    tp1.reset_prefix_cache()
    from_tp3 = _run(tp1, prompt)
    assert from_tp3.num_cached_tokens == PROMPT_BLOCKS * 16
    assert from_tp3.output_token_ids == first.output_token_ids


def test_tp3_reads_what_tp1_spilled(engines, kv3, redis_server, recomputed):
    redis_server.client().flushall()
    [prompt] = random_prompts([PROMPT_BLOCKS * 16 + 9], seed=63)
    tp1 = engines.get(kv3(redis_url=redis_server.url))
    tp1.reset_prefix_cache()
    _run(tp1, prompt)
    tp1.offload_prefix_cache()
    _wait_in_redis(tp1, prompt)
    tp3 = engines.get(kv3(tp_size=3, redis_url=redis_server.url))
    tp3.reset_prefix_cache()
    out = _run(tp3, prompt)
    assert out.num_cached_tokens == PROMPT_BLOCKS * 16
    assert out.output_token_ids == recomputed(prompt)


def test_a_block_missing_one_head_is_a_miss_never_a_mixed_block(engines, kv3, redis_server, recomputed):
    redis_server.client().flushall()
    [prompt] = random_prompts([PROMPT_BLOCKS * 16 + 2], seed=64)
    tp3 = engines.get(kv3(tp_size=3, redis_url=redis_server.url))
    tp3.reset_prefix_cache()
    _run(tp3, prompt)
    tp3.offload_prefix_cache()
    _wait_in_redis(tp3, prompt)
    client = redis_server.client()
    head_2 = [k for k in client.keys(b"*") if k.endswith(b":2")]
    assert len(head_2) == PROMPT_BLOCKS
    client.delete(*head_2)  # rank 2's values gone (evicted, expired): no block is whole
    tp3.reset_prefix_cache()
    out = _run(tp3, prompt)
    assert out.num_cached_tokens == 0
    assert out.output_token_ids == recomputed(prompt)


def test_tp_replica_events_replay_to_its_tier_key_sets(engines, kv3, redis_server):
    redis_server.client().flushall()
    slice_bytes = engines.get(kv3()).kv_cache.layout.block_bytes // 3  # one KV head of three
    engine = engines.get(kv3(tp_size=3, cpu_kv_cache_bytes=3 * slice_bytes, redis_url=redis_server.url))  # 3 blocks: the rest go on to Redis
    engine.reset_prefix_cache()
    follower = KeySets.from_snapshot(engine.kv_snapshot())
    for prompt in random_prompts([40, 70, 90, 33], seed=65):
        _run(engine, prompt)
        engine.offload_prefix_cache()
    assert engine.kv_store.redis.flush() and engine.kv_store.redis.wait_confirmed()  # every block written is confirmed or given up: its event is in
    for batch in engine.kv_events_since(follower.seq):
        follower.apply(batch)
    sets = engine.kv_store.key_sets()
    assert {tier: set(follower.keys[tier]) for tier in Tier} == sets
    assert sets[Tier.CPU] and sets[Tier.REDIS]
