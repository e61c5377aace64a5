"""The planner's development set: the generators' shapes, and bench.planner_devset end to end on two traces."""

from __future__ import annotations

import json

import pytest

from bench import planner as planner_bench
from bench import planner_devset, planner_sets, planner_traces


def _rate(trace, start_s: float, end_s: float) -> float:
    return sum(start_s <= a.time_s < end_s for a in trace) / (end_s - start_s)


def test_the_flash_crowd_multiplies_the_rate_for_ten_minutes():
    trace = planner_traces.generate_flash_crowd(5, rate=4.0)
    per_minute = [_rate(trace, 60 * m, 60 * (m + 1)) for m in range(60)]
    crowded = [m for m, r in enumerate(per_minute) if r > 12.0]
    assert 9 <= len(crowded) <= 11 and crowded == list(range(crowded[0], crowded[0] + len(crowded)))
    assert 15 <= crowded[0] <= 45
    quiet = [r for m, r in enumerate(per_minute) if m not in crowded and m + 1 not in crowded and m - 1 not in crowded]
    assert 3.0 < sum(quiet) / len(quiet) < 5.0


def test_bursts_are_sized_from_the_start_up_time():
    for burst_s in (30.0, 240.0):
        trace = planner_traces.generate_bursts(3, burst_s, duration_s=3600.0, base_rate=2.0)
        busy = [s for s in range(0, 3600, 10) if _rate(trace, s, s + 10) > 5.0]
        spells, start = [], busy[0]
        for a, b in zip(busy, busy[1:] + [None]):
            if b != a + 10:
                spells.append(a + 10 - start)
                start = b
        longest = max(spells)
        assert 0.5 * burst_s <= longest <= 1.5 * burst_s + 20


def test_the_generators_are_seeded_and_the_conv_trace_can_be_rescaled():
    assert planner_traces.generate_code_spells(1, 600.0) == planner_traces.generate_code_spells(1, 600.0)
    assert planner_traces.generate_heavy_tail(1, 600.0) != planner_traces.generate_heavy_tail(2, 600.0)
    conv = planner_traces.read_arrivals(planner_traces.CONV_TRACE)
    assert len(conv) == 19_366 and 3400 < conv[-1].time_s < 3600
    squeezed = planner_traces.rescale(conv, 0.5)
    assert squeezed[-1].time_s == conv[-1].time_s / 2 and [a.prompt_tokens for a in squeezed] == [a.prompt_tokens for a in conv]
    tail = planner_traces.generate_heavy_tail(4)
    assert max(a.prompt_tokens for a in tail) > 20 * sorted(a.prompt_tokens for a in tail)[len(tail) // 2]


def test_the_devset_replays_every_trace_and_counts_the_goals(tmp_path, capsys):
    out = tmp_path / "devset.json"
    argv = ["--traces", "bursts_short", "heavy_tail", "--policies", "splitserve", "hpa", "--jobs", "1", "--max-prefill", "6", "--max-decode", "6", "--json", str(out), "--table"]
    assert planner_devset.main(argv) == 0
    report = json.loads(out.read_text())
    assert list(report["traces"]) == ["bursts_short", "heavy_tail"]
    for entry in report["traces"].values():
        assert list(entry["policies"]) == ["static", "splitserve", "hpa"]  # static always, first: the others start from it
        assert set(entry["goals"]) == {"attainment_within_0.01_of_static", "replica_hours_over_static", "direction_changes_per_hour_per_pool"}
    assert report["traces"]["heavy_tail"]["trace_stats"]["infeasible_requests"] > 0
    met = report["summary"]["goals_met"]
    assert met["direction_changes_per_hour_per_pool"] == sum(t["goals"]["direction_changes_per_hour_per_pool"]["met"] for t in report["traces"].values())
    table = capsys.readouterr().err
    assert "| bursts_short | static " in table and "| heavy_tail | splitserve |" in table


def test_bench_planner_writes_a_development_trace_and_replays_it(tmp_path):
    path, out = tmp_path / "spells.csv", tmp_path / "planner.json"
    argv = ["--trace", str(path), "--generate", "spells", "--policies", "static", "--max-prefill", "8", "--max-decode", "4", "--json", str(out)]
    assert planner_bench.main(argv) == 0
    expected = planner_traces.generate_code_spells(14)
    written = planner_traces.read_arrivals(path)
    assert [a.prompt_tokens for a in written] == [a.prompt_tokens for a in expected]
    assert json.loads(out.read_text())["trace_stats"]["num_requests"] == len(expected)


def test_a_seed_offset_draws_held_out_traces_of_the_same_shapes():
    dev, held_out = planner_sets.dev_set(), planner_sets.dev_set(seed_offset=10)
    assert list(held_out) == list(dev)
    assert held_out["bursts_long"]() == planner_traces.generate_bursts(23, 240.0) != dev["bursts_long"]()
    assert held_out["bursty_0"]() == planner_traces.generate_bursty(10)
    assert held_out["conv_x2"]() == dev["conv_x2"]()  # recorded, not generated


def test_a_scale_superposes_independent_draws_of_the_same_shape(tmp_path, capsys):
    one = planner_sets.draw("outside", "late_step", seed_offset=10)
    assert one == planner_sets.outside_set(seed_offset=10)["late_step"]()
    three = planner_sets.draw("outside", "late_step", seed_offset=10, scale=3)
    assert set(one) < set(three) and set(planner_sets.outside_set(seed_offset=1010)["late_step"]()) < set(three)
    assert 8 < _rate(three, 0, 2700) < 10 and 17 < _rate(three, 2700, 5400) < 19  # 3 and 6 req/s, three times
    assert [a.time_s for a in three] == sorted(a.time_s for a in three)
    with pytest.raises(planner_traces.BenchError, match="conv_x2 is a recorded trace"):
        planner_sets.draw("dev", "conv_x2", scale=2)
    out = tmp_path / "scaled.json"
    assert planner_devset.main(["--set", "outside", "--traces", "trickle", "--scale", "2", "--policies", "static", "--jobs", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["scale"] == 2 and report["traces"]["trickle"]["trace_stats"]["num_requests"] == len(planner_sets.draw("outside", "trickle", scale=2))
    for argv, message in ((["--traces", "conv", "--scale", "2"], "--traces conv: recorded traces"), (["--scale", "0"], "--scale must be at least 1")):
        with pytest.raises(SystemExit):
            planner_devset.main([*argv, "--json", str(out)])
        assert message in capsys.readouterr().err


def test_the_devset_replays_held_out_traces_when_asked(tmp_path, capsys):
    out = tmp_path / "held_out.json"
    argv = ["--traces", "bursts_short", "--policies", "splitserve", "--seed-offset", "10", "--jobs", "1", "--max-prefill", "6", "--max-decode", "6", "--json", str(out)]
    assert planner_devset.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["seed_offset"] == 10
    assert report["traces"]["bursts_short"]["trace_stats"]["num_requests"] == len(planner_traces.generate_bursts(21, 30.0))


def test_the_outside_set_keeps_its_shapes_and_replays_apart_from_the_development_set(tmp_path, capsys):
    outside = planner_sets.outside_set()
    assert not set(outside) & set(planner_sets.dev_set())
    idle = outside["idle_then_load"]()
    assert idle[0].time_s >= 2400 and 5.5 < _rate(idle, 2400, 4200) < 6.5
    saw = outside["sawtooth"]()
    assert _rate(saw, 0, 60) < 2 < 8 < _rate(saw, 540, 600)
    periodic = outside["periodic"]()  # two start-ups at 12 req/s in every six
    assert _rate(periodic, 0, 120) > 10 and _rate(periodic, 120, 360) < 3
    code = outside["code_like"]()  # 1-2 minute bursts of 10-17 req/s between quiet spells of 1 req/s
    per_minute = [_rate(code, m * 60, m * 60 + 60) for m in range(60)]
    assert max(per_minute) > 9 and sorted(per_minute)[20] < 2 and max(a.prompt_tokens for a in code) <= 7400
    noisy_trace = outside["noisy_steady"]()
    noisy = [_rate(noisy_trace, m * 60, m * 60 + 60) for m in range(90)]
    assert 3 < sum(noisy) / 90 < 5.5 and min(noisy) < 2.5 < 6 < max(noisy)
    sparse = outside["code_sparse"]()  # the code trace's figures: about 2.6 req/s over 57 minutes
    assert 2.0 < len(sparse) / 3420 < 3.5 and max(_rate(sparse, m * 60, m * 60 + 60) for m in range(57)) > 9
    spikes = outside["spikes"]()
    assert _rate(spikes, 1110, 1200) > 12 and _rate(spikes, 0, 1110) < 2.5
    drift = outside["prompt_drift"]()
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    early, late = (median([a.prompt_tokens for a in drift if lo <= a.time_s < lo + 600]) for lo in (0, 3000))
    assert early < 1000 < 2000 < late and 3.5 < _rate(drift, 0, 3600) < 4.5
    answers = outside["answer_bursts"]()
    long_, short = (median([a.output_tokens for a in answers if (a.time_s % 900 < 300) == flag]) for flag in (True, False))
    assert long_ > 1000 > 300 > short
    decay = outside["decay"]()
    assert _rate(decay, 0, 60) > 12 and 5.5 < _rate(decay, 600, 660) < 8 and _rate(decay, 3000, 3600) < 2
    walk_trace = outside["random_walk"]()  # a rate walking minute by minute: near from one minute to the next
    walk = [_rate(walk_trace, m * 60, m * 60 + 60) for m in range(90)]
    step, apart = (sum(abs(walk[m + lag] - walk[m]) for m in range(90 - lag)) / (90 - lag) for lag in (1, 45))
    assert step < apart / 2 and max(walk) > 2 * min(walk)
    square = outside["square_30"]()
    assert [round(_rate(square, h * 1800, h * 1800 + 1800)) for h in range(4)] == [2, 8, 2, 8]
    storm = outside["retry_storm"]()
    assert _rate(storm, 600, 720) == 0 and _rate(storm, 720, 780) > 10 and 3 < _rate(storm, 0, 600) < 5
    chatty = outside["chatty_crowd"]()
    crowd, calm = (median([a.output_tokens for a in chatty if (2100 <= a.time_s < 2820) == flag]) for flag in (True, False))
    assert crowd > 1000 > 300 > calm
    long_context = outside["long_context"]()
    assert median([a.prompt_tokens for a in long_context]) > 6000 and _rate(long_context, 1800, 3600) > 1.6 * _rate(long_context, 0, 1800)
    clumped = outside["clumped"]()  # a steady mean in clumps: counts of 10 s spread far wider than Poisson's
    tens = [_rate(clumped, t, t + 10) * 10 for t in range(0, 3600, 10)]
    mean = sum(tens) / len(tens)
    assert 3.5 < mean / 10 < 4.5 and sum((x - mean) ** 2 for x in tens) / len(tens) > 2 * mean
    tenants = outside["tenant_mix"]()  # the document job's 4k-token prompts come only in its 15 minutes
    documents = [a for a in tenants if a.prompt_tokens > 2000]
    assert len(documents) > 1000 and all(2100 <= a.time_s < 3000 for a in documents if a.output_tokens < 100 and a.prompt_tokens > 2500)
    assert 4.5 < _rate(tenants, 2100, 3000) < 5.5 and 2.5 < _rate(tenants, 0, 2100) < 3.5
    sine = outside["sine_20"]()
    assert _rate(sine, 0, 120) < 3 < 7 < _rate(sine, 540, 660) and _rate(sine, 1140, 1260) < 3
    late = outside["late_step"]()
    assert 2.5 < _rate(late, 0, 2700) < 3.5 and 5.5 < _rate(late, 2700, 5400) < 6.5
    batches = outside["doc_batches"]()  # 12k-token prompts in the last minute of every ten (the chat's tail seldom reaches 9k)
    in_batch = [a.time_s % 600 >= 540 for a in batches if a.prompt_tokens > 9000]
    per_minute_in, per_minute_out = sum(in_batch) / 6, (len(in_batch) - sum(in_batch)) / 54
    assert 150 < sum(in_batch) < 250 and per_minute_in > 10 * per_minute_out
    switching_trace = outside["switching"]()  # two rates, few minutes between them
    switching = [_rate(switching_trace, m * 60, m * 60 + 60) for m in range(90)]
    highs, lows = sum(r > 5 for r in switching), sum(r < 3.5 for r in switching)
    assert highs > 15 and lows > 15 and highs + lows > 80
    hawkes = outside["hawkes"]()  # 1.5 / (1 - 0.6) req/s, in clusters: 10 s counts spread wider than Poisson's
    tens = [_rate(hawkes, t, t + 10) * 10 for t in range(0, 3600, 10)]
    mean = sum(tens) / len(tens)
    assert 3.2 < mean / 10 < 4.3 and sum((x - mean) ** 2 for x in tens) / len(tens) > 1.3 * mean
    agents = outside["agent_sessions"]()  # each turn's prompt carries the context so far
    assert median([a.prompt_tokens for a in agents]) > 3000 and sum(a.prompt_tokens > 8000 for a in agents) > len(agents) / 10
    v_shape = outside["v_shape"]()
    assert _rate(v_shape, 0, 120) > 7 and _rate(v_shape, 1740, 1860) < 3 and _rate(v_shape, 3480, 3600) > 7
    small = outside["small_fast"]()
    assert 14 < _rate(small, 0, 3600) < 17 and median([a.prompt_tokens for a in small]) < 200 and median([a.output_tokens for a in small]) < 150
    square_60 = outside["square_60"]()
    assert [round(_rate(square_60, h * 3600, h * 3600 + 3600)) for h in range(4)] == [2, 8, 2, 8]
    for name, high_s, rates in (("long_on", 2400, (7, 2)), ("long_off", 1200, (8, 2))):
        on_off = outside[name]()  # a level for ``high_s`` in every hour, three hours
        assert [round(_rate(on_off, h * 3600 + lo, h * 3600 + hi)) for h in range(3) for lo, hi in ((0, high_s), (high_s, 3600))] == list(rates) * 3
    sine_90 = outside["sine_90"]()
    assert _rate(sine_90, 0, 300) < 2.5 < 8 < _rate(sine_90, 2550, 2850) and _rate(sine_90, 5250, 5550) < 2.5 and _rate(sine_90, 10500, 10800) < 2.5
    out = tmp_path / "outside.json"
    assert planner_devset.main(["--set", "outside", "--traces", "trickle", "--policies", "splitserve", "--jobs", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["set"] == "outside" and list(report["traces"]) == ["trickle"]
    assert report["traces"]["trickle"]["trace_stats"]["num_requests"] == len(outside["trickle"]())
    with pytest.raises(SystemExit):
        planner_devset.main(["--set", "outside", "--traces", "flash_crowd"])
    assert "--traces flash_crowd: not in --set outside (idle_then_load, sawtooth" in capsys.readouterr().err
