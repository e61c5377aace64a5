"""bench.twin's schedule, its arithmetic over pairs and its refusals (the run is in tests/integration/test_twin_bench.py)."""

import statistics

import pytest

from bench import twin
from bench.e2e import EngineSteps
from engine.request import RequestTrace


def test_twins_share_lengths_and_differ_in_their_first_token_only():
    plan = twin.schedule(40, 0.5, (16, 128), (16, 64), 49152, seed=3)
    assert len(plan) == 40
    times = [at for at, _, _ in plan]
    assert times == sorted(times) and times[0] > 0
    firsts = set()
    for i, (_, g, d) in enumerate(plan):
        assert len(g.prompt_token_ids) == len(d.prompt_token_ids) and g.num_output_tokens == d.num_output_tokens
        assert g.prompt_token_ids[1:] == d.prompt_token_ids[1:] and g.prompt_token_ids[0] != d.prompt_token_ids[0]
        assert (g.prompt_token_ids[0] < d.prompt_token_ids[0]) == (i % 2 == 0)  # which door gets the lower token alternates
        firsts |= {g.prompt_token_ids[0], d.prompt_token_ids[0]}
    assert len(firsts) == 80  # no two requests share a first block
    # Poisson: the mean gap is near 1 / rate.
    assert 1.2 < statistics.fmean(b - a for a, b in zip(times, times[1:])) < 3.0


def _pair(index, *, hops=0.003, gap=0.001, miss=0.0, pickup=0.040, prefill=0.300, request_plane=0.0001):
    """A pair sent at t; the direct twin reaches the engine at once, the gRPC twin ``gap`` later;
    with ``miss`` the gRPC twin's first step is that much later than its twin's."""
    t = 100.0 * (index + 1)
    sched = t + pickup
    direct = twin.Twin(t, t + pickup + prefill, RequestTrace(t, sched, sched, t + pickup + prefill, 1, 200), t + pickup + prefill)
    g_sched = sched + miss
    g_first_step_end = g_sched + prefill
    resumed = g_first_step_end
    g_arrival = t + gap
    # The client sees the first token after the hops out; the hops in (gap) are before arrival.
    first = resumed + (hops - gap)
    grpc = twin.Twin(t, first + request_plane, RequestTrace(g_arrival, g_sched, g_sched, g_first_step_end, 1, 200), resumed, request_plane)
    return twin.Pair(index, grpc, direct)


def test_same_step_pairs_differ_by_the_hops_less_the_later_arrival():
    pair = _pair(0, hops=0.003, gap=0.001)
    assert pair.same_step and pair.gap_s == pytest.approx(0.001)
    assert pair.added_s == pytest.approx(0.003 + 0.0001 - 0.001)
    missed = _pair(1, miss=0.180)
    assert not missed.same_step and missed.added_s == pytest.approx(0.180 + 0.0021)


def test_summary_splits_same_step_pairs_from_misses_and_judges_the_goal():
    pairs = [_pair(i) for i in range(98)] + [_pair(98, miss=0.180), _pair(99, miss=0.200)]
    out = twin.summarize(pairs, EngineSteps(steps=1000, tokens=50_000, step_s=100.0, cpu_s=99.0))
    assert out["num_pairs"] == 100
    assert out["ttft_ms_added"]["mean"] == pytest.approx(2.1 + 3.8, abs=0.01)  # 98 x 2.1 ms and two misses of 182.1, 202.1
    assert out["same_step"]["num_pairs"] == 98
    assert out["same_step"]["ttft_ms_added"]["mean"] == pytest.approx(2.1, abs=0.001)
    assert out["same_step"]["of_which_hops_ms"]["mean"] == pytest.approx(3.0, abs=0.001)
    assert out["same_step"]["stage_ms_added"]["pickup"] == pytest.approx(-1.0, abs=0.001)  # reached the engine 1 ms later, same boundary
    assert out["same_step"]["stage_ms_added"]["prefill"] == pytest.approx(0.0, abs=0.001)
    assert out["missed"] | {"ttft_ms_added": None} == {
        "num_pairs": 2,
        "fraction": 0.02,
        "expected_fraction": 0.01,  # 1 ms gap over a 100 ms mean step
        "ttft_ms_added": None,
        "grpc_later": 2,
        "direct_later": 0,
    }
    assert out["engine"]["step_ms_mean"] == 100.0
    low, high = out["ttft_ms_added"]["mean_ci95"]
    assert low <= out["ttft_ms_added"]["mean_ci95_t"][0] and high >= out["ttft_ms_added"]["mean_ci95_block_bootstrap"][1]
    assert out["goal"] == {"ttft_ms_added_max": 5.0, "within_goal": False, "shown_within_goal": False, "shown_over_goal": False}
    assert len(out["pairs"]) == 100 and out["pairs"][98][2] is False

    quiet = twin.summarize([_pair(i) for i in range(100)], EngineSteps(1000, 50_000, 100.0, 99.0))
    assert quiet["goal"]["within_goal"] and quiet["goal"]["shown_within_goal"] and quiet["missed"]["num_pairs"] == 0
    slow = twin.summarize([_pair(i, hops=0.009) for i in range(100)], EngineSteps(1000, 50_000, 100.0, 99.0))
    assert slow["goal"]["shown_over_goal"] and not slow["goal"]["within_goal"]


def test_block_bootstrap_widens_for_correlated_neighbours():
    iid = [float(i % 2) for i in range(200)]  # alternating: neighbours anti-correlated
    runs = [float((i // 20) % 2) for i in range(200)]  # runs of 20: neighbours correlated
    assert twin.block_bootstrap_ci95(runs, 20)[0] < twin.block_bootstrap_ci95(runs, 1)[0]
    assert twin.block_bootstrap_ci95(iid, 200) == [0.5, 0.5]  # one block: every resample is the series
    low, high = twin.block_bootstrap_ci95(iid, 1)
    assert low < 0.5 < high


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pairs", "1"], "--pairs: at least 2"),
        (["--pair-rate", "0"], "--pair-rate: must be > 0"),
        (["--busy-streams", "0"], "--busy-streams: at least 1"),
        (["--prompt-len", "9", "3"], "--prompt-len: need 2 <= MIN <= MAX"),
        (["--engine-cpus", "4095"], "--engine-cpus: CPUs 4095 are not among this process's CPUs"),
    ],
)
def test_bad_arguments_stop_it_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        twin.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_misses_on_both_sides_cancel_and_are_counted_by_side():
    # Twins reaching the engine in either order, 1 ms apart; one miss each way, at one cost.
    pairs = [_pair(i, gap=0.001 if i % 2 else -0.001) for i in range(98)]
    pairs += [_pair(98, gap=0.001, miss=0.300), _pair(99, gap=-0.001, miss=-0.300)]
    out = twin.summarize(pairs, EngineSteps(steps=1000, tokens=50_000, step_s=100.0, cpu_s=99.0))
    assert (out["gap_ms"], out["abs_gap_ms"]) == (0.0, 1.0)
    assert (out["missed"]["grpc_later"], out["missed"]["direct_later"]) == (1, 1)
    assert out["missed"]["expected_fraction"] == 0.01
    # The two misses cancel: the mean is the pairs' hops, less each one's way in.
    expected = statistics.fmean(1000 * p.added_s for p in pairs[:98])
    assert out["ttft_ms_added"]["mean"] == pytest.approx(expected, abs=0.01)
