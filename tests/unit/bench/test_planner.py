"""bench.planner end to end on a small generated trace: structure, the invariants, the plot, bad input."""

from __future__ import annotations

import json

import pytest

from bench import hindsight as bench_hindsight
from bench import planner as bench_planner
from bench import planner_sim as bench_planner_sim
from bench.report import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--max-prefill", "4", "--max-decode", "4"]


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "bursty.csv"
    bench_planner.write_csv(bench_planner.generate_bursty(seed=1, duration_s=900.0, base_rate=3.0), path)
    return path


def test_every_policy_is_replayed_and_the_books_balance(trace_path, tmp_path, capsys):
    out, png = tmp_path / "planner.json", tmp_path / "planner.png"
    assert bench_planner.main(["--trace", str(trace_path), *SMALL, "--json", str(out), "--plot", str(png)]) == 0

    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert set(report) == {"trace", "trace_stats", "perf_model", "cost_scale", "planner_config", "policies", "goals", "machine"}
    assert report["perf_model"] == "splitwise llama2-70b h100-80gb TP4"
    assert list(report["policies"]) == ["static", "splitserve", "hpa"]  # static first: the others start from its split
    span_h = report["trace_stats"]["span_s"] / 3600
    for name, result in report["policies"].items():
        assert result["replica_hours"] == pytest.approx(result["prefill_replica_hours"] + result["decode_replica_hours"])
        assert 0 <= result["slo_attainment"] <= 1 and result["direction_changes"] >= 0
        assert f"] {name}: attainment " in captured.err
    static = report["policies"]["static"]
    assert static["slo_attainment"] >= report["planner_config"]["attainment_target"]
    assert static["direction_changes"] == 0
    assert static["prefill_replica_hours"] == pytest.approx(static["split"]["prefill"] * span_h)
    assert static["decode_replica_hours"] == pytest.approx(static["split"]["decode"] * span_h)
    assert set(report["goals"]) == {"attainment_within_0.01_of_static", "replica_hours_over_static", "direction_changes_per_hour_per_pool"}
    assert static["target_reached"] is True and static["attainment_bar"] == report["planner_config"]["attainment_target"]
    assert report["trace_stats"]["mostly_infeasible"] is False
    for name in ("splitserve", "hpa"):  # they start from static's split
        assert report["policies"][name]["direction_changes"] == sum(report["policies"][name]["direction_changes_per_pool"].values())
        busiest, changes = report["policies"][name]["direction_changes_busiest_hour"], report["policies"][name]["direction_changes_per_pool"]
        assert set(busiest) == {"prefill", "decode"} and all(0 <= busiest[p] <= changes[p] for p in busiest)
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_the_generator_is_seeded(tmp_path):
    assert bench_planner.generate_bursty(seed=3, duration_s=600.0) == bench_planner.generate_bursty(seed=3, duration_s=600.0)
    assert bench_planner.generate_bursty(seed=3, duration_s=600.0) != bench_planner.generate_bursty(seed=4, duration_s=600.0)


def _one_sentence(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.planner: ") and "Traceback" not in err
    return err


def test_a_malformed_csv_line_is_named_by_its_number(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:50.99,many,109\n")
    assert run("planner", bench_planner.main, ["--trace", str(path)]) == 2
    assert "line 3 is not a request (TIMESTAMP, ContextTokens, GeneratedTokens)" in _one_sentence(capsys)


def test_a_malformed_mooncake_line_is_named_by_its_number(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\nnot json\n')
    assert run("planner", bench_planner.main, ["--trace", str(path)]) == 2
    assert "line 2 is not JSON" in _one_sentence(capsys)


def test_a_missing_trace_and_a_missing_header_are_one_sentence(tmp_path, capsys):
    missing = tmp_path / "missing.csv"
    assert run("planner", bench_planner.main, ["--trace", str(missing)]) == 2
    assert "no such file" in _one_sentence(capsys)
    headless = tmp_path / "headless.csv"
    headless.write_text("1,2,3\n")
    assert run("planner", bench_planner.main, ["--trace", str(headless)]) == 2
    assert "line 1 names no column for an arrival time" in _one_sentence(capsys)


def test_the_planner_starts_from_static_and_meets_a_sustained_step_without_chasing_past_it():
    """A step from 1 to 12 long prompts a second at 900 s, held for ten minutes: the planner, started
    from static's split, keeps static's attainment less 0.01 and never asks for max."""
    trace = [bench_planner.Arrival(t / 1.0, 2000, 50) for t in range(900)]
    trace += [bench_planner.Arrival(900 + t / 12, 2000, 50) for t in range(12 * 600)]
    config = bench_planner.PlannerConfig(max_prefill=8, max_decode=8)
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    static, _ = bench_planner.replay(trace, perf, config, "static")
    result, timeline = bench_planner.replay(trace, perf, config, "splitserve", static=static)
    prefill = {round(row[0]): row[2] for row in timeline}
    assert prefill[30] == static["split"]["prefill"]
    assert max(prefill.values()) < config.max_prefill and result["infeasible_intervals"] == 0
    assert result["slo_attainment"] >= static["slo_attainment"] - 0.01


def test_without_a_static_split_reaching_the_target_the_bar_is_the_best_reachable_and_infeasible_prompts_are_counted(tmp_path):
    """A fifth of the prompts take longer to prefill than the TTFT SLO: no split reaches 0.95, so the
    static split is the cheapest reaching the best attainment any split reaches (less 0.001),
    reported as such, and the planner is judged against it."""
    trace = [bench_planner.Arrival(t / 2, 40_000 if t % 5 == 0 else 800, 50) for t in range(2 * 900)]
    path = tmp_path / "long.csv"
    bench_planner.write_csv(trace, path)
    out = tmp_path / "planner.json"
    assert bench_planner.main(["--trace", str(path), *SMALL, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    static = report["policies"]["static"]
    assert static["target_reached"] is False and static["attainment_bar"] < 0.95
    assert static["attainment_bar"] == pytest.approx(static["best_attainment"] - bench_planner.STATIC_SLACK)
    assert static["slo_attainment"] >= static["attainment_bar"]
    assert report["trace_stats"]["infeasible_requests"] == len(trace) // 5 and report["trace_stats"]["mostly_infeasible"] is False
    ours = report["policies"]["splitserve"]
    observed = [a for a in trace if a.time_s <= trace[-1].time_s // 30 * 30]  # the last partial interval is never observed
    assert ours["infeasible_requests"] == sum(a.prompt_tokens == 40_000 for a in observed)
    assert ours["max_replicas"]["prefill"] < 4  # the long prompts never drove it to max
    assert report["goals"]["attainment_within_0.01_of_static"]["target"] == f">= {static['slo_attainment'] - 0.01:.4f}"


def test_a_trace_no_replica_count_serves_is_reported_not_crashed_on(tmp_path, capsys):
    trace = [bench_planner.Arrival(t, 60_000, 10) for t in range(120)]
    path = tmp_path / "hopeless.csv"
    bench_planner.write_csv(trace, path)
    out = tmp_path / "planner.json"
    assert bench_planner.main(["--trace", str(path), *SMALL, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["trace_stats"]["mostly_infeasible"] is True and report["trace_stats"]["infeasible_share"] == 1.0
    assert report["policies"]["static"]["best_attainment"] == 0.0
    assert "no replica prefills within the TTFT SLO" in capsys.readouterr().err
    # With no prompt the SLO can be met for, none of their work grows the prefill pool, nor the KV
    # they fill the decode pool: the planner spends what static spends.
    ours = report["policies"]["splitserve"]
    assert ours["max_replicas"]["prefill"] == 0 and ours["infeasible_intervals"] == 0
    assert ours["max_replicas"]["decode"] == report["policies"]["static"]["split"]["decode"]


def test_a_boolean_planner_setting_is_a_flag_that_reaches_the_planner(trace_path, tmp_path, capsys):
    out = tmp_path / "planner.json"
    argv = ["--trace", str(trace_path), *SMALL, "--policies", "splitserve", "--json", str(out)]
    assert bench_planner.main([*argv, "--aggregate-when-cheaper"]) == 0
    assert json.loads(out.read_text())["planner_config"]["aggregate_when_cheaper"] is True
    assert bench_planner.main(argv) == 0
    assert json.loads(out.read_text())["planner_config"]["aggregate_when_cheaper"] is False


def test_the_hindsight_schedule_pays_for_start_up_and_merges_runs_closer_than_it():
    """After three quiet intervals, intervals 3 and 5 miss 100 requests with one replica and none
    with two; a second replica costs 1 per interval plus 2 to start (the first interval's count
    starts free, as static's split does). Priced high enough, both intervals get it, as one run
    (1 + 1 + 1 + 2 = 5) rather than two (2 * (1 + 2) = 6); runs four apart stay two; priced at
    nothing, no interval gets it."""
    quiet = [[0, 0]] * 3
    misses = quiet + [[100, 0], [0, 0], [100, 0], [0, 0]]
    assert bench_hindsight.cheapest_schedule(misses, [1, 2], lead=2, lam=1.0) == [1, 1, 1, 2, 2, 2, 1]
    assert bench_hindsight.cheapest_schedule(misses, [1, 2], lead=2, lam=0.0) == [1] * 7
    apart = quiet + [[100, 0], [0, 0], [0, 0], [0, 0], [100, 0], [0, 0]]
    assert bench_hindsight.cheapest_schedule(apart, [1, 2], lead=2, lam=1.0) == [1, 1, 1, 2, 1, 1, 1, 2, 1]


def test_hindsight_has_its_prefill_replicas_ready_for_a_spell_of_load_and_costs_less_than_static():
    """Two long prompts a second, with a spell of twelve a second from 900 s to 1,200 s: the schedule
    adds replicas for the spell only, asked for one start-up ahead, and reaches static's attainment
    less 0.01 with fewer replica-hours than static's split held all along."""
    trace = [bench_planner.Arrival(t / 2, 2000, 50) for t in range(2 * 1800)]
    trace += [bench_planner.Arrival(900 + t / 12, 2000, 50) for t in range(12 * 300)]
    trace.sort()
    config = bench_planner.PlannerConfig(max_prefill=8, max_decode=8)
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    static, _ = bench_planner.replay(trace, perf, config, "static")
    result, timeline = bench_planner.replay(trace, perf, config, "hindsight", static=static)
    assert result["reached_target"] and result["slo_attainment"] >= static["slo_attainment"] - 0.01
    assert result["replica_hours"] < static["replica_hours"]
    assert result["decode_replica_hours"] == pytest.approx(static["decode_replica_hours"])
    prefill = {round(row[0]): row[2] for row in timeline}
    ask_s = 900 - round(config.startup_s)
    assert prefill[ask_s] > prefill[ask_s - 60] and prefill[1500] < prefill[1050]
    assert result["direction_changes"] == 1


def test_a_ramp_is_met_by_the_trend_rule_before_the_window_alone_would_meet_it():
    """1 request a second of 2000-token prompts for 40 minutes (the pools settle at the base after
    the warm-up), then a ramp to 16 a second over ten minutes: the trend rule grows the prefill pool
    to each count past 2 sooner than the window alone does, and misses fewer requests."""
    trace, t = [], 0.0
    while t < 3600:
        trace.append(bench_planner.Arrival(t, 2000, 50))
        t += 1 / (1.0 if t < 2400 else min(16.0, 1.0 + 15.0 * (t - 2400) / 600))
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    replays = {}
    for rise_start_ups in (None, 0):
        # Each rise met at its own step below the deployment of 4 (no room kept for the ramp's own
        # rises, no rise met ahead of a trend), so that the trend rule alone runs ahead; no launch
        # protection, so that the pools are at the base when the ramp begins.
        config = bench_planner.PlannerConfig(
            max_prefill=8, max_decode=8, rise_start_ups=rise_start_ups, rise_step_below_deployment=1, rise_room_below_deployment=False,
            rise_ahead_below_deployment=False, hold_deployment_until_needed_s=0.0,
        )
        replays[rise_start_ups] = bench_planner.replay(trace, perf, config, "splitserve", static={"split": {"prefill": 4, "decode": 2}})
    (trend, trend_timeline), (window, window_timeline) = replays[None], replays[0]

    def first_at(timeline, count: int) -> float:
        return next(row[0] for row in timeline if row[0] >= 2400 and row[2] >= count)

    assert [row[2] for row in trend_timeline if 2370 <= row[0] <= 2400] == [1, 1]  # shrunk to the base before the ramp
    for count in (3, 4):
        assert first_at(trend_timeline, count) < first_at(window_timeline, count)
    assert trend["slo_attainment"] > window["slo_attainment"]


def test_the_replay_observes_the_tokens_streamed_in_each_interval_and_the_sequences_running():
    """As a live router counts them: a 3,000-token answer streams over several intervals, not all in
    the one it arrived in; the decode pool reports the sequences still running at each tick. (The
    trace's output tokens are those decoded after the first.)"""
    from bench.planner_sim import Simulation

    config = bench_planner.PlannerConfig()
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = [bench_planner.Arrival(1.0, 500, 3000), bench_planner.Arrival(2.0, 500, 3000), bench_planner.Arrival(400.0, 500, 1)]
    seen = []
    Simulation(trace, perf, config, lambda now, obs, pools, use: seen.append(obs), (1, 1)).run()
    streamed = [o.num_output_tokens for o in seen]
    assert streamed[0] < 3000 and sum(1 for n in streamed if n) >= 3  # spread over the intervals it took
    # every token once (rounded per interval): each answer's first, out of its prefill, and its decoded ones
    assert abs(sum(streamed) - sum(1 + a.output_tokens for a in trace)) <= len(streamed) / 2
    assert seen[0].decode_running == 2 and seen[-1].decode_running == 0


def test_a_decode_replica_prefilling_its_own_prompts_holds_them_as_a_queue_not_a_batch():
    """With no prefill replica, 300 prompts arriving at once queue on the one decode replica, which
    prefills them one after another (about 0.3 s each). At the first tick only those it has
    prefilled are running sequences; the rest are queued prompt tokens, as the engine reports them."""
    from bench.planner_sim import Simulation

    config = bench_planner.PlannerConfig()
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = [bench_planner.Arrival(1.0 + i * 0.01, 2000, 500) for i in range(300)] + [bench_planner.Arrival(600.0, 100, 1)]
    seen = []
    Simulation(trace, perf, config, lambda now, obs, pools, use: seen.append(obs) or {"prefill": 0, "decode": 1}, (0, 1)).run()
    first = seen[0]
    prefilled = int(29.0 // perf.prefill_s(2000))  # the queue starts at 1 s
    assert abs(first.decode_running - prefilled) <= 1
    assert first.queued_prefill_tokens == first.decode_queued_prefill_tokens == pytest.approx((300 - prefilled) * 2000, rel=0.02)
    assert seen[1].decode_running == 300 and seen[1].queued_prefill_tokens == 0  # all prefilled by 60 s, decoding


def test_the_replay_counts_the_sequences_of_a_draining_decode_replica():
    """A decode replica given back drains: it takes nothing new but finishes its batch, and the
    cluster status (what the live loop sums) still lists it, so its sequences are still running."""
    from bench.planner_sim import Simulation

    config = bench_planner.PlannerConfig()
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = [bench_planner.Arrival(1.0, 500, 3000), bench_planner.Arrival(2.0, 500, 3000), bench_planner.Arrival(400.0, 500, 1)]
    seen = []

    def controller(now, obs, pools, use):
        seen.append((obs.decode_running, pools["decode"].ready, pools["decode"].draining))
        return {"prefill": 1, "decode": 1}  # give one back at the first tick

    Simulation(trace, perf, config, controller, (1, 2)).run()
    assert seen[0] == (2, 2, 0)
    assert seen[1] == (2, 1, 1)  # one ready, one draining: both answers still decoding


def test_a_decode_replica_takes_no_more_than_its_kv_holds_and_a_request_waiting_for_room_stalls():
    """Two 6k-token prompts (1,500-token answers) prefilled at once on a decode replica whose KV holds 8k tokens: the
    second waits for the first to finish, its first token out of its prefill, its answer stalled,
    so its ITL counts the wait; the KV in use never passes what the replica holds. A third, bigger
    than any replica's KV, still runs on an empty one."""
    from bench.planner_sim import Simulation

    config = bench_planner.PlannerConfig()
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = [bench_planner.Arrival(1.0, 6000, 1500), bench_planner.Arrival(1.0, 6000, 1500), bench_planner.Arrival(300.0, 9000, 100), bench_planner.Arrival(500.0, 100, 1)]
    seen = []
    sim = Simulation(trace, perf, config, lambda now, obs, pools, use: seen.append(obs), (2, 1), kv_tokens=8000)
    sim.run()
    assert sim.start_s[1] == sim.first_s[1] and sim.finish_s[1] >= sim.finish_s[0]  # it joined only once the first left
    own_s = sim.finish_s[0] - sim.start_s[0]
    assert (sim.finish_s[1] - sim.start_s[1]) > own_s + (sim.finish_s[0] - sim.first_s[1]) * 0.99
    assert all(o.kv_usage is None or o.kv_usage <= 1 for o in seen) and seen[0].decode_running == 1
    assert sim.finish_s[2] > 300  # too big for any replica's KV, run alone
    roomy = Simulation(trace, perf, config, lambda *_: None, (2, 1))  # the default KV holds both at once
    roomy.run()
    assert roomy.finish_s[1] < sim.finish_s[1]


def test_decode_replicas_prefilling_their_own_prompts_share_them_whatever_their_kv():
    """With no prefill pool, six 6k-token prompts at once spread three and three over two decode
    replicas whose KV holds 8k tokens each: the local path takes them as the engine's own queue."""
    from bench.planner_sim import Simulation

    config = bench_planner.PlannerConfig()
    perf = bench_planner.load_splitwise_csv(bench_planner.DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = [bench_planner.Arrival(1.0, 6000, 1500) for _ in range(6)] + [bench_planner.Arrival(600.0, 100, 1)]
    batches = []

    def controller(now, obs, pools, use):
        batches.append(sorted(len(r.heap) for r in sim.replicas["decode"]))
        return {"prefill": 0, "decode": 2}

    sim = Simulation(trace, perf, config, controller, (0, 2), kv_tokens=8000)
    sim.run()
    assert batches[0] == [3, 3]


def test_the_busiest_hour_of_flapping_is_reported_and_judged_not_hidden_in_the_mean():
    """Timeline rows are (time, rate, prefill, decode): prefill turns 13 times within one hour of a
    ten-hour trace (a mean of 1.3 an hour) and decode never; the goal fails on that hour."""
    rows = [(0.0, 0.0, 1, 1)] + [(60.0 * (i + 1), 0.0, 2 if i % 2 == 0 else 1, 1) for i in range(14)] + [(36000.0, 0.0, 1, 1)]
    assert bench_planner_sim._busiest_hour(bench_planner_sim._turns(rows, 2)) == 13 and bench_planner_sim._busiest_hour(bench_planner_sim._turns(rows, 3)) == 0
    spread = [(0.0, 0.0, 1, 1)] + [(3000.0 * (i + 1), 0.0, 2 if i % 2 == 0 else 1, 1) for i in range(14)]
    assert bench_planner_sim._busiest_hour(bench_planner_sim._turns(spread, 2)) == 2  # turns 50 minutes apart: two in an hour at most
    ours = {"slo_attainment": 1.0, "replica_hours": 1.0, "direction_changes_per_pool": {"prefill": 13, "decode": 0}}
    static = {"slo_attainment": 1.0, "replica_hours": 1.0}
    assert bench_planner.evaluate_goals({"splitserve": ours, "static": static}, 36000.0)["direction_changes_per_hour_per_pool"]["met"]
    flapping = {**ours, "direction_changes_busiest_hour": {"prefill": 13, "decode": 0}}
    goal = bench_planner.evaluate_goals({"splitserve": flapping, "static": static}, 36000.0)["direction_changes_per_hour_per_pool"]
    assert goal["value"] == 13 and not goal["met"]
