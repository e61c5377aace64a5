"""bench.e2e_pool: saved reports pooled with one run as one sample."""

import json

import pytest

from bench import e2e_pool


def _report(tmp_path, name, by_round, serving_path=3.4, engine=None, control=0.0, ci95=None, pairs=100, wall_s=600.0):
    mean = sum(by_round) / len(by_round)
    open_loop = {
        "ttft_ms_added_vs_bracket": {"mean": mean, "mean_by_round": by_round, "num_pairs": pairs, "mean_ci95": ci95 or [mean - 1.96, mean + 1.96]},
        "ttft_ms_added_mean_split": {"serving_path": serving_path, "worker": 0.0},
        "control_ttft_ms_paired": {"mean": control},
    }
    if engine is not None:
        open_loop["engine_vs_bracket"] = {"step_time_added": engine, "cpu_time_added": engine / 2, "stall_ms_per_step": {"grpc": 0.35, "peer": 0.22}}
    path = tmp_path / name
    results = [{"system": "grpc_open", "wall_s": wall_s / 2}, {"system": "engine_loop_open", "wall_s": wall_s / 2}]
    path.write_text(json.dumps({"engine_cpus": [0], "open_loop": open_loop, "results": results}))
    return path


def test_runs_are_the_samples_and_rounds_of_a_run_do_not_narrow_the_interval(tmp_path, capsys):
    # Two runs whose rounds agree closely but whose means differ (a per-run effect).
    files = [_report(tmp_path, "a.json", [1.0, 1.2, 0.8, 1.0], engine=-0.02), _report(tmp_path, "b.json", [9.0, 9.2, 8.8, 9.0], engine=0.003)]
    assert e2e_pool.main([str(f) for f in files]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["over_runs"]["num_runs"] == 2 and out["over_runs"]["mean"] == 5.0
    runs_low, runs_high = out["over_runs"]["ci95"]
    rounds_low, rounds_high = out["over_rounds"]["ci95"]
    assert out["over_rounds"]["num_rounds"] == 8
    assert runs_high - runs_low > 5 * (rounds_high - rounds_low)
    assert out["runs"][0]["engine_step_time_added"] == -0.02 and out["runs"][1]["rounds"] == 4
    assert out["mean_within_goal"] is True and out["ci95_within_goal"] is False


def test_a_run_within_the_goal_everywhere_is_reported_so(tmp_path, capsys):
    files = [_report(tmp_path, f"{i}.json", [3.0 + 0.1 * i, 3.2]) for i in range(4)]
    assert e2e_pool.main([str(f) for f in files]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ci95_within_goal"] is True
    assert out["serving_path_ms_mean_over_runs"] == 3.4


@pytest.mark.parametrize("content, message", [("{not json", "cannot read a JSON report"), (json.dumps({"open_loop": None}), "no open-loop rounds")])
def test_a_file_that_is_not_an_open_loop_report_is_named(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = _report(tmp_path, "good.json", [1.0, 2.0])
    assert e2e_pool.main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: {message}" in err


def test_the_added_time_splits_over_runs_beside_the_a_a_control(tmp_path, capsys):
    files = [
        _report(tmp_path, "a.json", [6.0, 8.0], serving_path=3.0, engine=-0.01, control=5.0),
        _report(tmp_path, "b.json", [2.0, 4.0], serving_path=4.0, engine=0.01, control=-1.0),
    ]
    assert e2e_pool.main([str(f) for f in files]) == 0
    out = json.loads(capsys.readouterr().out)
    split = out["split_over_runs"]
    assert [r["worker_side_ms_mean"] for r in out["runs"]] == [4.0, -1.0]
    assert (split["serving_path_ms"]["mean"], split["worker_side_ms"]["mean"], split["control_ms"]["mean"]) == (3.5, 1.5, 2.0)
    assert split["engine_step_time_added_pct"] == {"num_runs": 2, "mean": 0.0, "ci95": [-12.71, 12.71]}
    assert split["engine_cpu_time_added_pct"]["mean"] == 0.0
    assert split["engine_stall_ms_per_step_added"]["mean"] == 0.13


def test_runs_needed_solves_the_t_interval_for_the_margin():
    # sd 1, margin 1: t(n-1) / sqrt(n) is 1.05 at n = 6 and 0.92 at n = 7
    assert e2e_pool.runs_needed(1.0, 1.0) == 7
    assert e2e_pool.runs_needed(1.0, 10.0) == 2
    assert e2e_pool.runs_needed(2.0, 1.0) > e2e_pool.runs_needed(1.0, 1.0)
    assert e2e_pool.runs_needed(1.0, 0.0) is None  # a serving path at or past the goal: no run count tells it within


def test_power_says_what_an_end_to_end_verdict_would_take(tmp_path, capsys):
    # Each run: 100 pairs with a bootstrap half-width of 1.96 ms, so a pair's sd is 10 ms.
    files = [_report(tmp_path, f"{i}.json", [m], serving_path=4.0, wall_s=1800.0) for i, m in enumerate([3.0, 5.0, 7.0])]
    assert e2e_pool.main([str(f) for f in files]) == 0
    power = json.loads(capsys.readouterr().out)["power"]
    assert power["margin_ms"] == 1.0 and power["run_mean_sd_ms"] == 2.0
    assert power["runs_needed"] == e2e_pool.runs_needed(2.0, 1.0)
    assert power["hours_needed"] == round(power["runs_needed"] * 0.5, 1)
    assert power["per_request_sd_ms"] == 10.0
    assert power["request_pairs_needed"] == 385  # (1.96 x 10 / 1)^2 = 384.2


def _verdict(tmp_path, capsys, runs):
    files = [_report(tmp_path, f"{i}.json", **run) for i, run in enumerate(runs)]
    assert e2e_pool.main([str(f) for f in files]) == 0
    return json.loads(capsys.readouterr().out)["verdict"]


def test_the_verdict_needs_the_path_the_engine_and_the_end_to_end_estimate_within_the_goal(tmp_path, capsys):
    # Runs like the measured ones, the end-to-end estimate 3 ms above them: path ~3.5, engine either way.
    measured = [
        {"by_round": [m], "serving_path": p, "engine": e}
        for m, p, e in [(-2.0, 3.4, -0.018), (4.4, 3.5, 0.0), (12.5, 3.6, 0.001), (-1.8, 3.5, -0.007), (10.4, 3.7, 0.002)]
    ]
    within = _verdict(tmp_path, capsys, measured)
    assert within == {
        "serving_path_within_goal": True,
        "engine_not_shown_slower": True,
        "end_to_end_within_goal": True,
        "end_to_end_goal_excluded": False,
        "met": True,
    }
    slow_path = [r | {"serving_path": r["serving_path"] + 1.5} for r in measured]
    assert _verdict(tmp_path, capsys, slow_path) == within | {"serving_path_within_goal": False, "met": False}
    slow_engine = [r | {"engine": r["engine"] + 0.02} for r in measured]
    assert _verdict(tmp_path, capsys, slow_engine) == within | {"engine_not_shown_slower": False, "met": False}
    above = [r | {"by_round": [r["by_round"][0] + 3.0]} for r in measured]  # estimate 7.7: not met, not excluded
    assert _verdict(tmp_path, capsys, above) == within | {"end_to_end_within_goal": False, "met": False}
    far = [r | {"by_round": [r["by_round"][0] + 12.0]} for r in measured]
    assert _verdict(tmp_path, capsys, far) == within | {"end_to_end_within_goal": False, "end_to_end_goal_excluded": True, "met": False}
    no_engine = [r | {"engine": None} for r in measured]
    assert _verdict(tmp_path, capsys, no_engine)["met"] is False  # nothing shows the engine is not slower
