"""bench.planner_adversary: the splice at a policy's own shrink, and the attack end to end on a trace where the planner saves."""

from __future__ import annotations

import json

import pytest

from bench import planner_adversary
from bench.planner_traces import Arrival


def _trace(times: list[float]) -> list[Arrival]:
    return [Arrival(t, 100 + i, 10) for i, t in enumerate(times)]


def test_a_splice_keeps_the_past_copies_the_stretch_in_and_moves_the_rest_later():
    trace = _trace([0.0, 5.0, 10.0, 11.0, 12.0, 30.0, 40.0])
    spliced = planner_adversary.splice(trace, 20.0, 10.0, 5.0)
    assert spliced[:5] == trace[:5]  # the past, as it was
    assert [(a.time_s, a.prompt_tokens) for a in spliced[5:8]] == [(20.0, 102), (21.0, 103), (22.0, 104)]  # [10, 15) copied to 20
    assert [(a.time_s, a.prompt_tokens) for a in spliced[8:]] == [(35.0, 105), (45.0, 106)]  # the rest, 5 s later
    assert [a.time_s for a in spliced] == sorted(a.time_s for a in spliced)


def test_the_stretch_is_the_busiest_the_deployment_served_within_its_slos():
    trace = _trace([0.0, 1.0, 2.0, 3.0, 10.0, 10.5, 11.0, 20.0])
    # The densest stretch, 10-11, was missed: the one before it, served, is the copy.
    met = [True, True, True, True, False, False, False, True]
    assert planner_adversary.busiest_served_stretch(trace, met, 4.0, 0.95) == (0.0, 4)
    assert planner_adversary.busiest_served_stretch(trace, [True] * 8, 2.0, 0.95) == (10.0, 3)


def test_the_first_shrink_is_the_first_row_with_a_pool_below_the_deployment():
    timeline = [(30.0, 1.0, 2, 2), (60.0, 1.0, 2, 2), (90.0, 1.0, 2, 1), (120.0, 1.0, 1, 1)]
    deployment = {"prefill": 2, "decode": 2}
    assert planner_adversary.first_shrink(timeline, deployment, -1.0) == (90.0, "decode", 1)
    assert planner_adversary.first_shrink(timeline, deployment, 90.0) == (120.0, "prefill", 1)
    assert planner_adversary.first_shrink(timeline[:2], deployment, -1.0) is None


@pytest.mark.slow
def test_a_splice_at_the_planner_s_shrink_breaks_the_target_that_held_before_it(tmp_path):
    out = tmp_path / "adversary.json"
    argv = ["--traces", "flash_crowd", "--policies", "splitserve", "hpa", "--jobs", "1", "--json", str(out)]
    assert planner_adversary.main(argv) == 0
    report = json.loads(out.read_text())
    entry = report["traces"]["flash_crowd"]["policies"]["splitserve"]
    # The planner saves on this trace and met the target before the splice.
    assert entry["before"]["splitserve_replica_hours_over_static"] < 1.0
    assert entry["before"]["splitserve"] >= entry["before"]["static"] - 0.01
    # Its decisions up to its shrink are the same on the spliced trace: only what came after changed.
    assert entry["same_until_shrink"] and entry["saved"]
    first = entry["splices"][0]
    assert first["replicas"] < first["deployment"]
    # The deployment serves the copy as it served the stretch; the shrunk pool does not.
    assert first["static"] >= entry["before"]["static"] - 0.001
    assert entry["target_broken"] and entry["after"]["splitserve"] < entry["after"]["static"] - 0.01
    assert entry["target_held_before"]
    assert report["summary"]["splitserve"] == {"traces": 1, "saved": 1, "saved_within_target": 1, "broken_of_those": 1, "same_until_shrink": True}
    assert report["traces"]["flash_crowd"]["policies"]["hpa"]["saved"]


@pytest.mark.parametrize("flag, value, said", [("--rounds", "0", "--rounds must be at least 1"), ("--stretch-s", "0", "--stretch-s must be above 0")])
def test_bad_options_are_usage_errors_naming_the_option(flag, value, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        planner_adversary.main(["--traces", "flash_crowd", flag, value])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--traces", "conv", "--scale", "2"], "--traces conv: recorded traces, which --scale cannot superpose"),
                                        (["--set", "outside", "--traces", "flash_crowd"], "--traces flash_crowd: not in --set outside")])
def test_traces_the_set_cannot_draw_are_usage_errors_naming_them(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        planner_adversary.main(argv)
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
