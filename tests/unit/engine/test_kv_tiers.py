"""The engine over its KV tiers: prefixes served from the CPU tier and from a real Redis give the
same tokens as recomputing them; tenants stay apart; Redis dying mid-run costs nothing but hits."""

from __future__ import annotations

import time

import pytest

from kv_store.events import KeySets, Tier
from tests.redis_server import RedisServer
from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts


def _run(engine, request_id, prompt, **kwargs):
    engine.add_request(request_id, prompt, GREEDY, **kwargs)
    before = engine.stats().num_computed_prompt_tokens
    [out] = engine.run_to_completion([request_id])
    return out, engine.stats().num_computed_prompt_tokens - before


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.REDIS])
def test_prefix_from_a_lower_tier_equals_recompute_fp32(tiny_llama_dir, redis_server, tier):
    [prompt] = random_prompts([70], seed=21)  # 4 full blocks reusable
    if tier is Tier.CPU:
        engine = make_engine(tiny_llama_dir, cpu_kv_cache_bytes=1 << 20)
    else:
        redis_server.client().flushall()
        engine = make_engine(tiny_llama_dir, redis_url=redis_server.url)
    try:
        first, computed_first = _run(engine, "a", prompt)
        assert engine.offload_prefix_cache() > 0
        if tier is Tier.REDIS:
            assert engine.kv_store.redis.flush()
        assert engine.pool.num_cached_blocks == 0
        again, computed_again = _run(engine, "b", prompt)
        assert (computed_first, computed_again) == (70, 70 - 64)
        assert again.num_cached_tokens == 64  # the usage reports tokens served from the tier
        assert again.output_token_ids == first.output_token_ids
        uncached = make_engine(tiny_llama_dir, enable_prefix_caching=False)
        assert again.output_token_ids == uncached.generate([prompt], GREEDY)[0].output_token_ids
        assert engine.kv_store.stats.tiers[tier].num_hits == 4
    finally:
        engine.close()


def test_tenants_never_share_tier_blocks(tiny_llama_dir, redis_server):
    redis_server.client().flushall()
    [prompt] = random_prompts([40], seed=22)
    engine = make_engine(tiny_llama_dir, cpu_kv_cache_bytes=1 << 20, redis_url=redis_server.url)
    try:
        _run(engine, "a", prompt, tenant_salt="tenant-a")
        engine.offload_prefix_cache()
        b, _ = _run(engine, "b", prompt, tenant_salt="tenant-b")
        c, _ = _run(engine, "c", prompt, tenant_salt="tenant-a")
        assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 32)
    finally:
        engine.close()


def test_engine_events_replay_to_its_key_sets(tiny_llama_dir, redis_server):
    redis_server.client().flushall()
    engine = make_engine(tiny_llama_dir, num_kv_blocks=12, cpu_kv_cache_bytes=3 * 16 * 4 * 2 * 16 * 2 * 4, redis_url=redis_server.url)
    replica = KeySets.from_snapshot(engine.kv_snapshot())
    try:
        for i, prompt in enumerate(random_prompts([40, 70, 33, 40, 90], seed=23)):
            _run(engine, f"r{i}", prompt)  # 12 blocks: every request evicts the one before
        engine.offload_prefix_cache()
        assert engine.kv_store.redis.flush()
        for batch in engine.kv_events_since(replica.seq):
            replica.apply(batch)
        sets = engine.kv_store.key_sets()
        assert replica.keys == sets
        assert sets[Tier.CPU] and sets[Tier.REDIS] and not sets[Tier.POOL]  # all offloaded, both tiers used
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        engine.close()


def test_redis_killed_mid_run_every_request_completes_and_the_tier_comes_back(tiny_llama_dir, tmp_path):
    redis_server = RedisServer(tmp_path).start()
    engine = make_engine(tiny_llama_dir, num_kv_blocks=16, redis_url=redis_server.url)
    shared = random_prompts([32], seed=24)[0]
    tails = random_prompts([8] * 100, seed=25)
    redis = engine.kv_store.redis
    try:
        for i, tail in enumerate(tails):
            if i == 30:
                redis_server.stop()
            if i == 60:
                redis_server.start()
            out, _ = _run(engine, f"r{i}", shared + tail)
            assert len(out.output_token_ids) == GREEDY.max_tokens
            if i == 29:
                engine.offload_prefix_cache()
                assert redis.flush()
        assert redis.stats_snapshot().num_errors >= 1  # it noticed Redis was gone
        deadline = time.monotonic() + 40  # the backoff (at most 30 s) runs out...
        while not redis.available:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _run(engine, "last", random_prompts([40], seed=26)[0])
        engine.offload_prefix_cache()
        assert redis.flush()
        assert redis_server.client().dbsize() > 0  # ...and the tier writes again (the restarted Redis began empty)
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        engine.close()
        redis_server.stop()
