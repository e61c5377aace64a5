"""The trace shapes bench.routing generates (each kind's structure), a malformed line, and the
live routing step's and the shapes' reports."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import routing as bench_routing
from bench.traces import BLOCK_TOKENS, KINDS, TraceConfig, TraceGenerator, TraceLineError, generate, read_trace, universal_ids

SMALL = TraceConfig(request_rate=4.0, num_tenants=4, num_agent_apps=2, tool_prompt_tokens_max=8000, warmup_s=30.0)


def test_short_sessions_have_at_most_four_short_turns():
    generator = TraceGenerator("short", SMALL, seed=1)
    sessions = [generator.session() for _ in range(200)]
    assert max(len(s) for s in sessions) <= 4 and min(len(s) for s in sessions) >= 1
    assert sum(len(s) for s in sessions) / len(sessions) < 2.5
    for steps in sessions:
        for before, after in zip(steps, steps[1:]):
            assert after.hash_ids[: before.input_length // BLOCK_TOKENS] == before.hash_ids[: before.input_length // BLOCK_TOKENS]


def test_deep_sessions_are_long_and_share_a_few_long_documents():
    generator = TraceGenerator("deep", SMALL, seed=2)
    sessions = [generator.session() for _ in range(40)]
    assert sum(len(s) for s in sessions) / len(sessions) > 10
    documents = Counter(s[0].hash_ids[:31] for s in sessions)  # 16k tokens: 31 full blocks at least
    assert len(documents) <= 4 and all(s[0].input_length >= 16000 for s in sessions)


def test_tool_sessions_share_one_long_tool_prompt_and_grow_by_short_steps():
    generator = TraceGenerator("tool", SMALL, seed=3)
    sessions = [generator.session() for _ in range(30)]
    shared = (SMALL.universal_prefix_tokens + 12000) // BLOCK_TOKENS
    assert len({s[0].hash_ids[:shared] for s in sessions}) == 1
    growth = [b.input_length - a.input_length for s in sessions for a, b in zip(s, s[1:])]
    assert sorted(growth)[len(growth) // 2] < 1000


def test_noisy_traces_have_a_tenth_of_requests_that_share_nothing():
    trace = generate("noisy", 1000, seed=4, config=SMALL)
    counts = Counter(h for r in trace for h in r.hash_ids)
    alone = [r for r in trace if all(counts[h] == 1 for h in r.hash_ids) and r.hash_ids[:1] != universal_ids(SMALL)[:1]]
    assert len(alone) >= 100  # the 10% replaced (a one-turn chat's last request may share nothing too)
    assert len(alone) <= 130
    assert set(KINDS) >= {"short", "deep", "tool", "noisy"}


def test_a_malformed_line_is_named_by_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}\n'
    path.write_text(good + good + '{"timestamp": 1, "input_length": "many"}\n')
    with pytest.raises(TraceLineError, match="line 3 is not a request"):
        read_trace(path)


def test_live_routing_step_report():
    live = bench_routing.live_decisions(num_workers=3, prompt_tokens=2048, num_sessions=2, num_turns=3)
    assert {"decide_us_p50", "decide_us_p99", "prompt_tokens", "workers"} <= set(live)
    assert (live["prompt_tokens"], live["workers"], live["num_decisions"], live["num_first_turns"]) == (2048, 3, 6, 2)
    assert 0 < live["decide_us_p50"] <= live["decide_us_p99"]


def test_shapes_and_sensitivity_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_routing, "SHAPES", ("short", "noisy"))
    monkeypatch.setattr(bench_routing, "SENSITIVITY", ("queue_weight",))
    trace = tmp_path / "tool.jsonl"
    out = tmp_path / "routing.json"
    cluster = ["--workers", "2", "--pool-tokens", "4096", "--cpu-tokens", "8192", "--redis-tokens", "32768", "--num-decode-workers", "2"]
    argv = ["--generate", "tool", "--trace", str(trace), "--requests", "120", "--trace-request-rate", "4", "--trace-warmup-s", "30",
            "--warmup-s", "0", "--shapes", str(tmp_path), "--sensitivity", "--policies", "splitserve", "round_robin", *cluster, "--json", str(out)]
    assert bench_routing.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["shapes"]) == {"short", "noisy"} and (tmp_path / "noisy.jsonl").is_file()
    for row in report["shapes"].values():
        assert set(row["policies"]) == {"splitserve", "round_robin"}
        assert set(row["policies"]["splitserve"]) >= {"hit_ratio_over_oracle", "load_max_over_mean", "ttft_s_p90"}
    assert set(report["sensitivity"]) == {"tool", "short", "noisy"}
    assert set(report["sensitivity"]["tool"]["queue_weight"]) == {"x0.5", "x2"}
