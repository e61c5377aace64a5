"""bench.e2e_pool: saved reports pooled with one run as one sample."""

import json

import pytest

from bench import e2e_pool


def _report(tmp_path, name, by_round, serving_path=3.4, engine=None):
    open_loop = {
        "ttft_ms_added_vs_bracket": {"mean": sum(by_round) / len(by_round), "mean_by_round": by_round},
        "ttft_ms_added_mean_split": {"serving_path": serving_path, "worker": 0.0},
    }
    if engine is not None:
        open_loop["engine_vs_bracket"] = {"step_time_added": engine}
    path = tmp_path / name
    path.write_text(json.dumps({"engine_cpus": [0], "open_loop": open_loop}))
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
