"""KV tiers of expert-parallel replicas: attention is data-parallel, so each rank holds whole
blocks of its own requests and spills them to its own CPU tier and to Redis, and loads them back
itself; Redis is one for every rank, so a request on one rank loads a prefix another rank spilled.
Real follower ranks (Ray actors joined by gloo), a real redis-server, a tiny random Mixtral at EP 2,
fp32 KV: a prefix that came back from a tier gives the tokens of recomputing it.

Requests land on ranks as the scheduler places them: of two prompts admitted together with
nothing cached, the first goes to rank 0 and the second to rank 1 (fewest running sequences, then
the lower rank); a prompt alone with nothing cached goes to rank 0.
"""

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

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
FOLLOWER_CPUS = 0.5
PROMPT_BLOCKS = 4


@pytest.fixture(scope="module")
def engines(follower_hosts):
    with parallel_engines(FOLLOWER_CPUS, "test-ep-tiers", follower_hosts) as e:
        yield e


@pytest.fixture(scope="module")
def moe(tiny_checkpoint):
    base = EngineConfig(model=str(tiny_checkpoint("mixtral")), kv_dtype="fp32", num_kv_blocks=32, max_num_batched_tokens=48)
    return lambda **overrides: replace(base, **overrides)


@pytest.fixture(scope="module")
def recomputed(engines, moe):
    """The greedy tokens of a prompt computed from scratch, at EP 1 without any cache."""
    engine = engines.get(moe(enable_prefix_caching=False))
    return lambda prompt: engine.generate([prompt], GREEDY)[0].output_token_ids


def _keys(engine, prompt: list[int]) -> set[int]:
    return set(block_keys(prompt, 16, engine.namespace.root_key(None))[:PROMPT_BLOCKS])


def _wait_in_redis(engine, prompt) -> None:
    wait_in_redis(engine, _keys(engine, prompt))


def _rank_moves(engines) -> int:
    [info] = engines.follower_infos()
    return info["num_tier_moves"]


def test_ep2_prefixes_come_back_from_each_rank_cpu_tier(engines, moe, recomputed):
    on_0, on_1 = random_prompts([PROMPT_BLOCKS * 16 + 5, PROMPT_BLOCKS * 16 + 7], seed=71)
    engine = engines.get(moe(ep_size=2, cpu_kv_cache_bytes=1 << 20))
    engine.reset_prefix_cache()
    first = engine.generate([on_0, on_1], GREEDY)
    assert _keys(engine, on_1) <= set(engine.pools[1].cached_keys()) and not _keys(engine, on_1) & set(engine.pools[0].cached_keys())
    moves_before = _rank_moves(engines)
    assert engine.offload_prefix_cache() >= 2 * PROMPT_BLOCKS
    assert not engine.pools[0].cached_keys() and not engine.pools[1].cached_keys()
    assert _keys(engine, on_0) | _keys(engine, on_1) <= engine.kv_store.key_sets()[Tier.CPU]
    # Reversed: rank 0 is free first, but each prompt goes to the rank whose CPU tier holds it.
    again = engine.generate([on_1, on_0], GREEDY)
    assert [out.num_cached_tokens for out in again] == [PROMPT_BLOCKS * 16] * 2
    assert _keys(engine, on_1) <= set(engine.pools[1].cached_keys())
    assert engine.kv_store.stats.tiers[Tier.CPU].num_hits >= 2 * PROMPT_BLOCKS
    assert _rank_moves(engines) >= moves_before + 2 * PROMPT_BLOCKS  # rank 1 saved and loaded its own blocks
    assert [out.output_token_ids for out in again] == [first[1].output_token_ids, first[0].output_token_ids]
    assert first[0].output_token_ids == recomputed(on_0) and first[1].output_token_ids == recomputed(on_1)


def test_ep2_a_rank_loads_from_redis_what_the_other_rank_spilled(engines, moe, redis_server, recomputed):
    redis_server.client().flushall()
    filler, prompt, other = random_prompts([2 * 16 + 3, PROMPT_BLOCKS * 16 + 3, 3 * 16 + 1], seed=72)
    engine = engines.get(moe(ep_size=2, redis_url=redis_server.url))
    engine.reset_prefix_cache()
    redis = engine.kv_store.redis
    puts_before = redis.stats_snapshot().num_puts
    engine.generate([filler, prompt], GREEDY)  # prompt on rank 1
    num_rank0_blocks = len(engine.pools[0].cached_keys())
    assert _keys(engine, prompt) <= set(engine.pools[1].cached_keys())
    engine.offload_prefix_cache()
    _wait_in_redis(engine, prompt)
    assert redis.flush() and redis.stats_snapshot().num_puts - puts_before == num_rank0_blocks  # rank 1 wrote its blocks itself

    # rank 0 reads what rank 1 wrote
    engine.reset_prefix_cache()
    hits_before = redis.stats_snapshot().num_hits
    [out] = engine.generate([prompt], GREEDY)
    assert out.num_cached_tokens == PROMPT_BLOCKS * 16
    assert redis.stats_snapshot().num_hits - hits_before >= PROMPT_BLOCKS  # read here, on rank 0
    assert out.output_token_ids == recomputed(prompt)

    # and rank 1 reads it again, itself: nothing of it on the leader
    engine.reset_prefix_cache()
    hits_before = redis.stats_snapshot().num_hits
    redis_hits_before = engine.kv_store.stats.tiers[Tier.REDIS].num_hits
    outs = engine.generate([other, prompt], GREEDY)
    assert outs[1].num_cached_tokens == PROMPT_BLOCKS * 16
    assert _keys(engine, prompt) <= set(engine.pools[1].cached_keys())
    assert redis.stats_snapshot().num_hits == hits_before  # the leader read no block
    assert engine.kv_store.stats.tiers[Tier.REDIS].num_hits - redis_hits_before >= PROMPT_BLOCKS
    assert outs[1].output_token_ids == recomputed(prompt) and outs[0].output_token_ids == recomputed(other)


def test_ep2_a_value_rank_1_cannot_read_is_a_miss_never_a_wrong_block(engines, moe, redis_server, recomputed):
    redis_server.client().flushall()
    filler, prompt = random_prompts([2 * 16 + 5, PROMPT_BLOCKS * 16 + 9], seed=73)
    engine = engines.get(moe(ep_size=2, redis_url=redis_server.url))
    engine.reset_prefix_cache()
    engine.generate([prompt], GREEDY)  # rank 0 spills it
    engine.offload_prefix_cache()
    _wait_in_redis(engine, prompt)
    third = block_keys(prompt, 16, engine.namespace.root_key(None))[2]
    client = redis_server.client()
    redis_key = engine.kv_store.redis.redis_key(third, 0)
    client.set(redis_key, client.get(redis_key)[:-7] + b"garbage")  # it exists, so the leader counts it; rank 1 refuses it
    engine.reset_prefix_cache()
    misses_before = engine.kv_store.stats.tiers[Tier.REDIS].num_misses
    outs = engine.generate([filler, prompt], GREEDY)  # prompt on rank 1
    assert outs[1].num_cached_tokens == 2 * 16  # the two blocks before the bad one
    assert engine.kv_store.stats.tiers[Tier.REDIS].num_misses > misses_before
    assert third not in engine.kv_store.key_sets()[Tier.REDIS]  # forgotten: the router no longer scores it
    assert outs[1].output_token_ids == recomputed(prompt)


def test_ep_replica_events_replay_to_the_union_of_its_ranks_key_sets(engines, moe, redis_server):
    redis_server.client().flushall()
    block_bytes = engines.get(moe()).kv_cache.layout.block_bytes
    engine = engines.get(moe(ep_size=2, cpu_kv_cache_bytes=3 * block_bytes, redis_url=redis_server.url))  # 3 blocks a rank: the rest go on to Redis
    engine.reset_prefix_cache()
    follower = KeySets.from_snapshot(engine.kv_snapshot())
    shared = random_prompts([40], seed=74)[0]
    for pair in (random_prompts([70, 33], seed=75), [shared, shared + [5, 6]], random_prompts([90, 50], seed=76)):
        engine.generate(pair, GREEDY)
        engine.offload_prefix_cache()
    assert engine.kv_store.redis.flush() and engine.kv_store.redis.wait_confirmed()  # every spill confirmed or given up: its event is in
    for batch in engine.kv_events_since(follower.seq):
        follower.apply(batch)
    sets = engine.kv_store.key_sets()
    assert {tier: set(follower.keys[tier]) for tier in Tier} == sets
    assert sets[Tier.CPU] and sets[Tier.REDIS]
    per_rank = [set(store.cpu.keys()) for store in engine.kv_store.ranks]
    assert per_rank[0] and per_rank[1] and sets[Tier.CPU] == per_rank[0] | per_rank[1]
