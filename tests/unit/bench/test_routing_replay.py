"""The routing trace replay (bench/routing.py) and its trace generator (bench/traces.py)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from bench.routing import evaluate_goals
from bench.routing_sim import BLOCK_TOKENS, ClusterConfig, Replay, oracle_hit_ratio
from bench.traces import TraceConfig, TraceGenerator, TraceRequest, describe, generate, read_trace, universal_ids, write_trace
from kv_store.events import KeySets, Tier
from router.routing.prefix_index import PrefixIndex

B = BLOCK_TOKENS


def _request(ms: int, num_tokens: int, ids: tuple[int, ...], output: int = 10) -> TraceRequest:
    return TraceRequest(ms, num_tokens, output, ids)


def test_oracle_counts_leading_full_blocks_seen_before():
    trace = [
        _request(0, 2 * B + 76, (1, 2, 3)),  # nothing seen yet; block 3 is partial: never cached
        _request(10, 3 * B, (1, 2, 4)),  # 1, 2 seen: 2 blocks
        _request(20, B + 88, (1, 5)),  # 1 seen: 1 block
        _request(30, 4 * B, (1, 2, 3, 7)),  # 3 was only ever a partial block: the run stops there
        _request(40, 3 * B + 1, (1, 2, 4, 8)),  # 1, 2, 4 seen: 3 blocks
    ]
    total = (2 * B + 76) + 3 * B + (B + 88) + 4 * B + (3 * B + 1)
    assert oracle_hit_ratio(trace) == pytest.approx((2 + 1 + 2 + 3) * B / total)
    # a warm-up fills the cache but is not counted
    assert oracle_hit_ratio(trace, warmup_s=0.025) == pytest.approx((2 + 3) * B / (4 * B + 3 * B + 1))


def test_generated_trace_round_trips_and_has_its_structure(tmp_path):
    trace = generate("mixed", 1500, seed=3)
    assert trace == generate("mixed", 1500, seed=3)
    assert trace != generate("mixed", 1500, seed=4)
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    assert len(trace) == 1500
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(trace, trace[1:])) and trace[0].timestamp_ms >= 0
    prefix = universal_ids()
    assert prefix == (0, 1)
    for request in trace:
        assert request.hash_ids[: len(prefix)] == prefix  # one prefix every request shares
        assert len(request.hash_ids) == math.ceil(request.input_length / B)
    assert describe(trace)["num_requests_32k"] > 0


def test_conversations_grow_by_extending_the_previous_turn():
    generator = TraceGenerator("multiturn", TraceConfig(), seed=5)
    num_pairs = 0
    for _ in range(50):
        turns = generator.conversation()
        for prev, cur in zip(turns, turns[1:]):
            prev_full = prev.hash_ids[: prev.input_length // B]
            assert cur.hash_ids[: len(prev_full)] == prev_full
            assert cur.input_length > prev.input_length + prev.output_length  # + the new user message
            assert cur.offset_s > prev.offset_s
            if prev.input_length % B:  # the partial block filled up: it gets a new id
                assert prev.hash_ids[-1] not in cur.hash_ids
            num_pairs += 1
    assert num_pairs > 100


def test_agent_loops_share_their_app_tool_prompt():
    config = TraceConfig()
    generator = TraceGenerator("agent", config, seed=6)
    app_blocks = [app.full_ids for app in generator.apps]
    assert max(len(ids) for ids in app_blocks) * B >= 32768 - B  # some tool prompts are 32k+ long
    by_app = Counter()
    for _ in range(100):
        steps = generator.agent_loop()
        app = next(i for i, ids in enumerate(app_blocks) if steps[0].hash_ids[: len(ids)] == ids)
        by_app[app] += 1
        for prev, cur in zip(steps, steps[1:]):
            prev_full = prev.hash_ids[: prev.input_length // B]
            assert cur.hash_ids[: len(prev_full)] == prev_full
    assert by_app.most_common(1)[0][1] >= 15  # Zipf: a popular app's prompt serves many sessions


def test_session_starts_are_bursty():
    generator = TraceGenerator("multiturn", TraceConfig(request_rate=20.0), seed=7)
    starts = generator._session_starts(2.0)
    times = []
    while len(times) < 4000:
        times.append(next(starts))
    counts = Counter(int(t // 10) for t in times)
    per_bin = [counts.get(i, 0) for i in range(min(counts), max(counts))]
    mean = sum(per_bin) / len(per_bin)
    variance = sum((c - mean) ** 2 for c in per_bin) / len(per_bin)
    assert variance / mean > 3  # a Poisson process has 1


def _small_cluster(**overrides) -> ClusterConfig:
    values = dict(num_workers=3, pool_tokens=6 * B, cpu_tokens=10 * B, redis_tokens=40 * B, num_decode_workers=2, decode_slots=4)
    values.update(overrides)
    return ClusterConfig(**values)


def test_ttft_is_queue_wait_plus_compute_plus_tier_loads():
    config = _small_cluster(num_workers=1, pool_tokens=2 * B, cpu_tokens=4 * B, event_delay_s=0.0)
    speed, cpu_speed = config.prefill_tokens_per_s, config.cpu_load_tokens_per_s
    trace = [
        _request(0, 2 * B + 100, (1, 2, 90)),  # computes 1124 tokens
        _request(0, 2 * B + 50, (1, 2, 91)),  # queued behind it, then hits 1 and 2 in the pool
        _request(1000, 2 * B, (3, 4)),  # evicts 1 and 2 to the CPU tier
        _request(2000, 3 * B, (1, 2, 5)),  # 1, 2 from the CPU tier, 5 computed
    ]
    replay = Replay(trace, "round_robin", config)
    result = replay.run()
    first = (2 * B + 100) / speed
    assert replay.ttft_s[0] == pytest.approx(first)
    assert replay.ttft_s[1] == pytest.approx(first + 50 / speed)
    assert replay.ttft_s[2] == pytest.approx(2 * B / speed)
    assert replay.ttft_s[3] == pytest.approx(B / speed + 2 * B / cpu_speed)
    total = sum(r.input_length for r in trace)
    assert result["hit_ratio_pool"] == pytest.approx(2 * B / total)
    assert result["hit_ratio_cpu"] == pytest.approx(2 * B / total)
    assert result["hit_ratio"] == pytest.approx(4 * B / total)


def test_the_index_fed_by_events_matches_the_simulated_caches():
    trace = generate("mixed", 600, seed=8, config=TraceConfig(request_rate=6.0, num_tenants=8, num_agent_apps=4, tool_prompt_tokens_max=12000))
    replay = Replay(trace, "splitserve", _small_cluster(), retain_batches=1_000_000)
    result = replay.run()
    assert 0 < result["hit_ratio_redis"] and 0 < result["hit_ratio_cpu"]  # every tier was used
    fresh = PrefixIndex()
    for worker in replay.workers:
        sets = KeySets(worker.worker_id)
        for batch in worker.log.since(0):
            sets.apply(batch)
            fresh.apply(batch)
        written = {key for key, writers in replay.redis.keys.items() if worker in writers}
        assert sets.keys[Tier.POOL] == set(worker.pool)
        assert sets.keys[Tier.CPU] == set(worker.cpu)
        assert sets.keys[Tier.REDIS] == written
        assert len(worker.pool) == worker.num_pool_blocks  # full: evictions happened
    assert len(replay.redis.keys) == replay.redis.num_blocks
    replay.index.forget_expired(float("inf"))  # the policy's memory of its last decisions
    for index in (fresh, replay.index):  # the router's own index, after the last event arrived
        for request in trace[::7]:
            keys = request.block_keys()
            runs = index.match(keys)
            assert {w.worker_id: w.cached_run(keys) for w in replay.workers} == runs


def test_splitserve_beats_round_robin_on_shared_prefixes():
    trace = generate("agent", 1200, seed=9, config=TraceConfig(request_rate=8.0, num_agent_apps=6, tool_prompt_tokens_max=20000))
    config = ClusterConfig(num_workers=4)
    ours = Replay(trace, "splitserve", config).run()
    round_robin = Replay(trace, "round_robin", config).run()
    oracle = oracle_hit_ratio(trace)
    assert ours["hit_ratio"] > round_robin["hit_ratio"] + 0.05
    assert ours["hit_ratio"] >= 0.9 * oracle
    goals = evaluate_goals(oracle, {"splitserve": ours, "round_robin": round_robin})
    assert goals["hit_ratio_over_oracle"]["met"] is True
    assert goals["ttft_s_p90_below_every_baseline"]["met"] == (ours["ttft_s_p90"] < round_robin["ttft_s_p90"])
