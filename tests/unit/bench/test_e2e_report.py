"""bench.e2e's arithmetic: pooled rounds, the serving path's cost against each peer, the goal."""

import os
import subprocess
import sys

import pytest

from bench.e2e import STAGES, EngineSteps, Run, bootstrap_ci95, main, peer_environ, poisson_arrivals, summarize, t_975, t_ci95, timings_stages, trace_stages, variant
from bench.workload import BenchRequest
from engine.cpus import format_cpu_list
from engine.request import RequestTrace
from proto import splitserve_pb2 as pb


def _run(system: str, round_: int, tokens: int, wall_s: float, ttft_s: list[float], path_s: list[float] = ()) -> Run:
    return Run(system, 8, round=round_, wall_s=wall_s, num_tokens=tokens, ttft_s=list(ttft_s), itl_s=[0.1], path_ttft_s=list(path_s))


def _runs(grpc_tokens: tuple[int, int], path_s: list[float]) -> list[Run]:
    runs = []
    for r in range(2):
        runs.append(_run("engine_step", r, 1000, 10.0, [0.20, 0.30, 0.40]))
        runs.append(_run("engine_loop", r, 1000, 10.0, [0.30, 0.40, 0.50]))
        runs.append(_run("grpc", r, grpc_tokens[r], 10.0, [0.302, 0.402, 0.502], path_s))
    return runs


def test_rounds_are_pooled_and_the_cost_is_taken_against_each_peer():
    report = summarize(_runs((950, 850), [0.003, 0.004, 0.002]))
    by = {(r["system"], r["concurrency"]): r for r in report["results"]}
    grpc = by[("grpc", 8)]
    assert (grpc["output_tok_per_s"], grpc["output_tok_per_s_by_round"], grpc["rounds"]) == (90.0, [95.0, 85.0], 2)
    assert grpc["serving_path_ttft_ms_p50"] == 3.0
    assert "serving_path_ttft_ms_p50" not in by[("engine_loop", 8)]
    loop_cost = report["serving_overhead"]["grpc_vs_engine_loop"]["8"]
    assert loop_cost == {"throughput_loss": 0.1, "throughput_loss_by_round": [0.05, 0.15], "ttft_ms_p50_added": 2.0, "ttft_ms_p50_added_by_round": [2.0, 2.0]}
    assert report["serving_overhead"]["grpc_vs_engine_step"]["8"]["ttft_ms_p50_added"] == 102.0


def test_the_goal_needs_throughput_and_the_serving_path_within_bounds():
    assert summarize(_runs((950, 950), [0.003] * 3))["goal"]["met"] is True
    assert summarize(_runs((850, 850), [0.003] * 3))["goal"]["met"] is False  # 15% of throughput
    slow_path = summarize(_runs((950, 950), [0.012] * 3))["goal"]
    assert (slow_path["met"], slow_path["serving_path_ttft_ms_p50"], slow_path["serving_path_ttft_ms_p99"]) == (False, 12.0, 12.0)


def test_the_goal_reports_the_end_to_end_p50_beside_the_peers_own_spread():
    runs = _runs((950, 950), [0.003] * 3)
    runs[1].ttft_s = [0.35, 0.45, 0.55]  # engine_loop, round 0: its p50 50 ms above round 1's
    goal = summarize(runs)["goal"]
    assert goal["ttft_ms_p50_added_by_round"] == [-48.0, 2.0]
    assert goal["peer_ttft_ms_p50_round_spread"] == 50.0
    assert goal["met"] is True  # judged on the per-request split, not on the p50 difference


def test_variants_keep_lengths_and_share_no_block_key():
    workload = [BenchRequest((40, 41, 42, 43), 5), BenchRequest((50, 51), 7)]
    a, b = variant(workload, 33), variant(workload, 34)
    assert [(len(r.prompt_token_ids), r.num_output_tokens) for r in a] == [(4, 5), (2, 7)]
    assert [r.prompt_token_ids[0] for r in a + b] == [33, 33, 34, 34]
    assert [r.prompt_token_ids[1:] for r in a] == [r.prompt_token_ids[1:] for r in workload]


def _open(system: str, round_: int, ttft_by_index: dict[int, float]) -> Run:
    return Run(
        system,
        8,
        round=round_,
        wall_s=10.0,
        num_tokens=100,
        ttft_s=list(ttft_by_index.values()),
        itl_s=[0.1],
        ttft_s_by_index=dict(ttft_by_index),
    )


def test_open_loop_pairs_requests_by_index_within_a_round():
    runs = _runs((950, 950), [0.003] * 3)
    runs += [
        _open("engine_loop_open", 0, {0: 0.100, 1: 0.200, 2: 0.300}),
        _open("grpc_open", 0, {2: 0.304, 0: 0.103, 1: 0.205}),  # finished in another order
        _open("engine_loop_open", 1, {0: 0.150, 1: 0.250, 2: 0.350}),
        _open("grpc_open", 1, {0: 0.152, 1: 0.256, 2: 0.351}),
    ]
    report = summarize(runs)
    paired = report["open_loop"]["ttft_ms_added_paired"]
    assert (paired["p50_by_round"], paired["mean_by_round"], paired["num_pairs"]) == ([4.0, 2.0], [4.0, 3.0], 6)
    assert paired["mean"] == 3.5
    assert paired["mean_ci95"][0] <= 3.5 <= paired["mean_ci95"][1]
    assert paired["mean_ci95_over_rounds"] == t_ci95([4.0, 3.0])
    assert report["goal"]["open_loop_ttft_ms_added_paired_mean_by_round"] == [4.0, 3.0]
    assert "control_ttft_ms_paired" not in report["open_loop"]
    assert report["goal"]["open_loop_ttft_ms_added_paired_mean"] == 3.5
    assert report["goal"]["met"] is True
    assert report["goal"]["end_to_end_met"] is True
    runs[-1] = _open("grpc_open", 1, {0: 0.250, 1: 0.350, 2: 0.450})  # a whole step late
    runs[-3] = _open("grpc_open", 0, {0: 0.200, 1: 0.300, 2: 0.400})
    assert (summarize(runs)["goal"]["end_to_end_met"], summarize(runs)["goal"]["met"]) == (False, False)


def test_the_open_loop_goal_is_the_paired_mean_not_the_median():
    """A path d ms slower moves a fraction of requests by a whole step and the rest not at all:
    the mean says what a request pays; the median can sit at either mode."""
    runs = _runs((950, 950), [0.003] * 3)
    loop = {i: 0.2 for i in range(10)}
    grpc = {i: (0.2 + (0.1 if i < 4 else -0.01)) for i in range(10)}  # 4 a step late, 6 ahead
    runs += [_open("engine_loop_open", 0, loop), _open("grpc_open", 0, grpc)]
    goal = summarize(runs)["goal"]
    assert (goal["open_loop_ttft_ms_added_paired_p50"], goal["open_loop_ttft_ms_added_paired_mean"]) == (-10.0, 34.0)
    assert (goal["end_to_end_met"], goal["met"]) == (False, False)


def test_open_loop_reports_the_a_a_control():
    runs = _runs((950, 950), [0.003] * 3)
    runs += [
        _open("engine_loop_open", 0, {0: 0.100, 1: 0.300}),
        _open("grpc_open", 0, {0: 0.190, 1: 0.250}),
        _open("engine_loop_open_repeat", 0, {0: 0.120, 1: 0.260}),
    ]
    report = summarize(runs)
    assert report["open_loop"]["ttft_ms_added_paired"]["mean"] == 20.0  # (+90 - 50) / 2
    assert report["open_loop"]["control_ttft_ms_paired"]["mean"] == -10.0  # (+20 - 40) / 2
    assert report["goal"]["open_loop_control_paired_mean_ci95"] == report["open_loop"]["control_ttft_ms_paired"]["mean_ci95"]


def test_the_goal_judges_the_grpc_run_against_the_in_process_runs_either_side():
    """The machine slows down run after run: the in-process repeat is 20 ms behind the first run
    on every request, gRPC 12 ms. Against the first run alone gRPC would seem to add 12 ms;
    against the average of the runs either side, 2 ms."""
    runs = _runs((950, 950), [0.003] * 3)
    first = {i: 0.2 + 0.01 * i for i in range(8)}
    runs += [
        _open("engine_loop_open", 0, first),
        _open("grpc_open", 0, {i: t + 0.012 for i, t in first.items()}),
        _open("engine_loop_open_repeat", 0, {i: t + 0.020 for i, t in first.items()}),
    ]
    report = summarize(runs)
    assert report["open_loop"]["ttft_ms_added_paired"]["mean"] == 12.0
    assert report["open_loop"]["ttft_ms_added_vs_bracket"]["mean"] == 2.0
    assert (report["goal"]["open_loop_against"], report["goal"]["open_loop_ttft_ms_added_paired_mean"], report["goal"]["met"]) == ("bracket", 2.0, True)
    runs[-2] = _open("grpc_open", 0, {i: t + 0.018 for i, t in first.items()})  # 8 ms over the bracket
    assert summarize(runs)["goal"]["met"] is False


def test_bootstrap_interval_brackets_the_estimate_and_narrows_with_samples():
    few = [float(v) for v in range(-20, 21, 4)]
    many = few * 25
    lo_few, hi_few = bootstrap_ci95(few, lambda v: sum(v) / len(v))
    lo_many, hi_many = bootstrap_ci95(many, lambda v: sum(v) / len(v))
    assert lo_few < 0 < hi_few and lo_many < 0 < hi_many
    assert hi_many - lo_many < (hi_few - lo_few) / 3
    assert bootstrap_ci95(few, lambda v: sum(v) / len(v)) == [lo_few, hi_few]  # seeded


def test_poisson_arrivals_are_seeded_and_increasing_at_the_rate():
    a = poisson_arrivals(2000, 4.0, seed=1)
    assert a == poisson_arrivals(2000, 4.0, seed=1) and a != poisson_arrivals(2000, 4.0, seed=2)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert abs(len(a) / a[-1] - 4.0) < 0.3


def test_the_interval_over_rounds_uses_students_t():
    # mean 2, sample sd 1, t(2 df) = 4.303: 2 -+ 4.303 / sqrt(3)
    assert t_ci95([1.0, 2.0, 3.0]) == [-0.48, 4.48]
    assert t_ci95([5.0, 5.0]) == [5.0, 5.0]
    assert t_ci95([7.0]) is None
    # Past the table's 10 degrees of freedom, the expansion meets published values of t.
    for df, t in [(11, 2.201), (20, 2.086), (30, 2.042), (60, 2.000), (120, 1.980)]:
        assert abs(t_975(df) - t) < 0.001
    assert t_975(10) > t_975(11) > t_975(1000) > 1.96
    # Rounds that disagree widen it however many requests each pooled.
    assert t_ci95([17.0, 4.0, 10.0, 9.0])[1] - t_ci95([17.0, 4.0, 10.0, 9.0])[0] > 2 * 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-cpus", "0"], "--engine-cpus: only with --modes aggregated"),
        (["--engine-cpus", "0-x", "--modes", "aggregated"], "--engine-cpus: '0-x' is not a CPU number"),
        (["--engine-cpus", format_cpu_list(set(os.sched_getaffinity(0))), "--modes", "aggregated"], "leaves no CPU for the serving threads"),
        (["--engine-cpus", "4095", "--modes", "aggregated"], "--engine-cpus: CPUs 4095 are not among this process's CPUs"),
    ],
)
def test_bad_engine_cpus_stop_the_bench_before_it_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_added_mean_splits_into_the_serving_path_and_the_worker():
    runs = _runs((950, 950), [0.003] * 3)
    first = {i: 0.2 + 0.01 * i for i in range(4)}
    grpc = _open("grpc_open", 0, {i: t + 0.010 for i, t in first.items()})
    grpc.path_ttft_s = [0.002, 0.004, 0.003, 0.007]  # mean 4 ms of hops; 6 ms more on the worker's side
    runs += [_open("engine_loop_open", 0, first), grpc, _open("engine_loop_open_repeat", 0, dict(first))]
    report = summarize(runs)
    assert report["open_loop"]["ttft_ms_added_mean_split"] == {"serving_path": 4.0, "worker": 6.0}
    grpc_row = next(r for r in report["results"] if r["system"] == "grpc_open")
    assert grpc_row["serving_path_ttft_ms_mean"] == 4.0


def _open_split(path_s: list[float]) -> list[Run]:
    runs = _runs((950, 950), [0.003] * 3)
    first = {i: 0.2 + 0.01 * i for i in range(4)}
    grpc = _open("grpc_open", 0, {i: t + 0.012 for i, t in first.items()})
    grpc.path_ttft_s = list(path_s)
    return runs + [_open("engine_loop_open", 0, first), grpc, _open("engine_loop_open_repeat", 0, dict(first))]


def test_the_verdict_takes_the_serving_path_per_request_and_reports_end_to_end_beside_it():
    """12 ms added end to end, of which the hops are 4 ms: the serving path is within the goal,
    and the report says the end-to-end number is not."""
    goal = summarize(_open_split([0.002, 0.004, 0.003, 0.007]))["goal"]
    assert (goal["open_loop_serving_path_ttft_ms_mean"], goal["open_loop_ttft_ms_added_paired_mean"]) == (4.0, 12.0)
    assert goal["open_loop_serving_path_ttft_ms_mean_ci95"][0] <= 4.0 <= goal["open_loop_serving_path_ttft_ms_mean_ci95"][1]
    assert (goal["serving_path_met"], goal["end_to_end_met"], goal["met"]) == (True, False, False)
    slow_hops = summarize(_open_split([0.006, 0.008, 0.007, 0.007]))["goal"]  # closed-loop p50 3 ms, open-loop mean 7 ms
    assert (slow_hops["serving_path_ttft_ms_p50"], slow_hops["open_loop_serving_path_ttft_ms_mean"], slow_hops["serving_path_met"]) == (3.0, 7.0, False)
    assert summarize(_runs((950, 950), [0.003] * 3))["goal"]["end_to_end_met"] is None  # no open loop: judged on the path alone


def test_the_engines_time_over_the_same_work_is_compared_with_the_runs_either_side():
    runs = _open_split([0.003] * 4)
    loop, grpc, repeat = runs[-3:]
    loop.engine = EngineSteps(steps=100, tokens=5000, step_s=10.0, cpu_s=9.9)
    repeat.engine = EngineSteps(steps=102, tokens=5000, step_s=10.2, cpu_s=10.1)
    grpc.engine = EngineSteps(steps=98, tokens=5000, step_s=10.3, cpu_s=10.1)  # 2% longer, 2 ms waits per step
    engine = summarize(runs)["open_loop"]["engine_vs_bracket"]
    assert (engine["tokens"], engine["steps"]) == ({"grpc": 5000, "peer": 5000}, {"grpc": 98, "peer": 101})
    assert (engine["step_time_added"], engine["step_time_added_by_round"], engine["cpu_time_added"]) == (0.0198, [0.0198], 0.01)
    assert engine["stall_ms_per_step"] == {"grpc": 2.041, "peer": 0.99}
    loop.queue_s, grpc.queue_s, repeat.queue_s = [0.010, 0.030], [0.030, 0.050], [0.020]
    assert summarize(runs)["open_loop"]["queue_ms_mean"] == {"grpc_open": 40.0, "engine_loop_open": 20.0, "engine_loop_open_repeat": 20.0}
    grpc_row = next(r for r in summarize(runs)["results"] if r["system"] == "grpc_open")
    assert (grpc_row["engine_steps"], grpc_row["engine_step_ms_mean"], grpc_row["engine_step_stall_ms_mean"]) == (98, 105.1, 2.041)
    loop.engine = None  # a run without counters: nothing to compare
    assert "engine_vs_bracket" not in summarize(runs)["open_loop"]


def test_a_workers_step_counters_are_read_from_its_prometheus_endpoint():
    from prometheus_client import CollectorRegistry

    from bench.e2e import counted, scraped_steps
    from engine.llm_engine import EngineStats
    from engine.metrics import EngineStatsCollector, serve_metrics

    stats = [EngineStats(1, 0, 64, 60, 0, 0, 0, 10, num_steps=7, num_step_tokens=90, step_s=0.5, step_cpu_s=0.25)]
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats[0], {"replica": "decode-0", "pool": "decode"}))
    url = serve_metrics(registry, "127.0.0.1", 0)
    assert scraped_steps(url) == EngineSteps(steps=7, tokens=90, step_s=0.5, cpu_s=0.25)

    def a_run() -> Run:
        stats[0] = EngineStats(1, 0, 64, 60, 0, 0, 0, 10, num_steps=10, num_step_tokens=130, step_s=0.75, step_cpu_s=0.5)
        return Run("grpc_open", 8)

    assert counted(lambda: scraped_steps(url), a_run).engine == EngineSteps(steps=3, tokens=40, step_s=0.25, cpu_s=0.25)
    empty = serve_metrics(CollectorRegistry(), "127.0.0.1", 0)
    with pytest.raises(RuntimeError, match="has no cpu_s, step_s, steps, tokens counter"):
        scraped_steps(empty)


def test_interference_compares_each_load_with_idle_in_the_same_run():
    from bench.interference import summarize as interference

    ms = lambda *v: [(x / 1000, x / 1000 * 0.99) for x in v]  # noqa: E731
    report = interference({"idle": [ms(100, 100, 101), ms(99, 100)], "memory": [ms(105, 105, 106), ms(104, 105)]})
    assert (report["idle"]["decode_step_ms_p50"], report["memory"]["decode_step_ms_p50"]) == (100.0, 105.0)
    assert (report["idle"]["slowdown_vs_idle"], report["memory"]["slowdown_vs_idle"]) == (0.0, 0.05)
    assert report["memory"]["decode_step_ms_p50_by_round"] == [105.0, 104.5]
    assert report["memory"]["num_steps"] == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine-cpu", "0", "--load-cpu", "0"], "--load-cpu: must differ from --engine-cpu"),
        (["--engine-cpu", "4095"], "--engine-cpu: CPU 4095 is not one this process may run on"),
    ],
)
def test_interference_refuses_cpus_it_cannot_use(argv, message, capsys):
    from bench.interference import main as interference_main

    with pytest.raises(SystemExit) as exit_:
        interference_main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_stages_from_a_trace_and_from_timings_add_up_to_the_ttft():
    trace = RequestTrace(arrival_s=10.000, admitted_s=10.030, first_scheduled_s=10.040, first_token_s=10.300)
    assert {k: round(v, 6) for k, v in trace_stages(trace, resumed_s=10.301).items()} == {"pickup": 0.03, "wait": 0.01, "prefill": 0.26, "handback": 0.001}
    timings = pb.Timings(worker_first_token_s=0.301, admitted_s=0.030, queue_s=0.040, first_step_end_s=0.300, request_plane_s=0.0005)
    stages = timings_stages(timings, ttft_s=0.305)
    assert list(stages) == list(STAGES)
    assert {k: round(v, 6) for k, v in stages.items()} == {
        "hops": 0.0035, "request_plane": 0.0005, "pickup": 0.03, "wait": 0.01, "prefill": 0.26, "handback": 0.001
    }
    assert abs(sum(stages.values()) - 0.305) < 1e-9


def _staged(system: str, stages_ms: dict[int, dict[str, float]]) -> Run:
    run = _open(system, 0, {i: sum(st.values()) / 1000 for i, st in stages_ms.items()})
    run.stages_by_index = {i: {k: v / 1000 for k, v in st.items()} for i, st in stages_ms.items()}
    return run


def test_the_added_ttft_is_placed_stage_by_stage_against_the_bracket():
    """gRPC pays 3 ms of hops, 0.5 ms in the request plane and 10 ms more pickup than the
    in-process runs either side (whose pickups differ by 4 ms: the A/A control sees that)."""
    runs = _runs((950, 950), [0.003] * 3)
    base = {"pickup": 20.0, "wait": 1.0, "prefill": 300.0, "handback": 0.5}
    loop = _staged("engine_loop_open", {i: dict(base) for i in range(4)})
    repeat = _staged("engine_loop_open_repeat", {i: base | {"pickup": 24.0} for i in range(4)})
    grpc = _staged("grpc_open", {i: base | {"hops": 3.0, "request_plane": 0.5, "pickup": 32.0} for i in range(4)})
    open_loop = summarize(runs + [loop, grpc, repeat])["open_loop"]
    added = open_loop["ttft_ms_added_by_stage"]
    assert {s: added[s]["mean"] for s in STAGES} == {"hops": 3.0, "request_plane": 0.5, "pickup": 10.0, "wait": 0.0, "prefill": 0.0, "handback": 0.0}
    assert round(sum(added[s]["mean"] for s in STAGES), 2) == open_loop["ttft_ms_added_vs_bracket"]["mean"] == 13.5
    assert added["pickup"]["mean_by_round"] == [10.0] and added["pickup"]["mean_ci95"] == [10.0, 10.0]
    assert open_loop["control_ttft_ms_by_stage"]["pickup"]["mean"] == 4.0
    assert open_loop["stage_ms_mean"]["grpc_open"]["hops"] == 3.0 and open_loop["stage_ms_mean"]["engine_loop_open"]["hops"] == 0.0
    loop.stages_by_index = {}  # runs without stages (older reports): no split
    assert "ttft_ms_added_by_stage" not in summarize(runs + [loop, grpc, repeat])["open_loop"]


def test_the_prefill_stages_added_time_splits_into_more_batch_tokens_and_slower_tokens():
    """In-process, a prompt's step computed 200 tokens in 300 ms (1.5 ms a token). gRPC's
    computed 210 (another request's tokens joined it) in 318 ms: 15 ms for the 10 tokens more
    at the in-process cost, 3 ms because each token cost more."""
    runs = _runs((950, 950), [0.003] * 3)
    base = {"pickup": 20.0, "wait": 0.0, "prefill": 300.0, "handback": 0.5}
    loop = _staged("engine_loop_open", {i: dict(base) for i in range(4)})
    repeat = _staged("engine_loop_open_repeat", {i: dict(base) for i in range(4)})
    grpc = _staged("grpc_open", {i: base | {"hops": 3.0, "prefill": 318.0} for i in range(4)})
    for run, tokens in ((loop, 200), (repeat, 200), (grpc, 210)):
        run.prefill_work_by_index = {i: (1, tokens) for i in range(4)}
    open_loop = summarize(runs + [loop, grpc, repeat])["open_loop"]
    assert open_loop["prefill_work"]["grpc_open"] == {"steps_mean": 1.0, "step_tokens_mean": 210.0, "us_per_step_token": 1514.29}
    assert open_loop["prefill_work"]["engine_loop_open"]["us_per_step_token"] == 1500.0
    assert open_loop["prefill_ms_added_split"] == {"more_step_tokens": 15.0, "slower_per_token": 3.0}


def test_the_in_process_engine_starts_with_the_omp_threads_ray_gives_a_worker():
    assert peer_environ({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}  # a decode worker reserves 1 CPU
    assert peer_environ({"OMP_NUM_THREADS": "4"}) is None  # set: Ray passes it on to the workers as it is


def test_run_as_a_program_the_bench_starts_again_in_that_environment_with_its_arguments():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import runpy, sys; sys.argv = ['bench.e2e', '--engine-cpus', '0-x', '--modes', 'aggregated']; runpy.run_module('bench.e2e', run_name='__main__')"
    probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 2 and "'0-x' is not a CPU number" in probe.stderr
    assert "bench.e2e: OMP_NUM_THREADS=1\n" in probe.stderr
    assert probe.stderr.count("bench.e2e: OMP_NUM_THREADS") == 1  # only the second start got as far
