"""SLAPlanner's decisions on a perf model whose numbers are easy to follow by hand.

Prefill takes 0.1 ms a token (10,000 tokens/s a replica; a 1000-token prompt is 0.1 s, and the
longest prompt one replica prefills within the 2 s TTFT SLO is 20,000 tokens). The prefill pool is
an Erlang-C queue whose waits, over a 1.9 s slack of 19 service times, leave at most 5% of prompts
late: prompt loads of 0.3, 1.0, 1.75, 2.125, 2.5 and 3 replicas need 1, 2, 2, 3, 3 and 4 of them.
Decode ITL is 0.02 + 0.001 * (batch - 1) s: the largest batch under 0.1 s is 81. A pool of n
replicas keeps room for the swing of all its sequences, 1.645 * sqrt(n * batch), so each replica's
batch is 81 less 1.645 * sqrt(batch / n): 67.5 alone (67.5 / 0.0865 = 780 tokens/s), 75.6 in a
pool of 7 (799 tokens/s), 76.5 in a pool of 10 (801).

Each interval's observed load is averaged over the last startup_s / interval_s intervals (two
here, with ``startup_s=60``), turned into counts, and the pools are sized for the request-weighted
0.95 quantile of the counts of the last ``base_window_s`` (default (60 + 30) / 0.05 = 1800 s). A
load that rose over each of the last four start-ups (the default here: 5! = 120 reaches the window's
60 intervals, 4! does not) grows the pool to its projection. Tests of the settling rules
(hysteresis, cooldown, starting replicas) pass ``ALONE`` so that each interval's count stands alone.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.perf_model import PerfModel
from planner.observation import Observation
from planner.policy import SLAPlanner

PERF = PerfModel([(100, 0.01), (10000, 1.0)], [(1, 0.02), (101, 0.12)], "hand-made")
INTERVAL_S = 30.0
REMEMBER = {"burst_memory_above_deployment": True}
"""The window's memory above the pools' first targets, which tests of its mechanics start small."""
ALONE = {"startup_s": 30.0, "base_window_s": 30.0, "rise_start_ups": 0}
"""No averaging over intervals, a window of one and no trend: each interval's count is what the pool needs."""


def observe(t: float, rate: float, prompt_tokens: int = 1000, output_tokens: int = 50, **fields) -> Observation:
    n = round(rate * INTERVAL_S)
    return Observation(t, INTERVAL_S, n, n * prompt_tokens, n * output_tokens, **fields)


def pools(prefill: int, decode: int, prefill_starting: int = 0, decode_starting: int = 0) -> dict[str, PoolReplicas]:
    return {
        "prefill": PoolReplicas("prefill", prefill + prefill_starting, prefill, prefill_starting),
        "decode": PoolReplicas("decode", decode + decode_starting, decode, decode_starting),
    }


MECHANICS = {"interval_s": INTERVAL_S, "startup_s": 60.0, "burst_growth_above_deployment": True, "hold_deployment_until_needed_s": 0.0, "level_memory_lengths": 0.0}
"""The tests of the planner's mechanics start small, from pools that are not a deployment to ride
bursts out at or to keep until the load has needed it, and with the window alone remembering levels
(launch protection and the memory of long levels have tests of their own)."""


def planner(**fields) -> SLAPlanner:
    """A planner whose pools may grow past their first targets for any load and go below them once
    the window allows (``MECHANICS``)."""
    return SLAPlanner(PlannerConfig(**{**MECHANICS, **fields}), PERF)


def run(p: SLAPlanner, rates, now: tuple[int, int], start_s: float = 30.0, **kw) -> list:
    """One decision per rate, an interval apart from ``start_s``, each target applied as if ready at once."""
    return decide_each(p, [observe(start_s + INTERVAL_S * i, rate, **kw) for i, rate in enumerate(rates)], now)


def decide_each(p: SLAPlanner, observations, now: tuple[int, int]) -> list:
    """One decision per observation, each target applied as if ready at once."""
    decisions = []
    for observation in observations:
        decision = p.decide(observation, pools(*now))
        now = (decision.targets["prefill"], decision.targets["decode"])
        decisions.append(decision)
    return decisions


def prefill_targets(decisions) -> list[int]:
    return [d.targets["prefill"] for d in decisions]


def test_a_sustained_burst_of_prompts_grows_prefill_only():
    p = planner()
    assert dict(run(p, [5] * 6, (1, 1))[-1].targets) == {"prefill": 1, "decode": 1}  # 5,000 prompt tokens/s: 0.5 replicas
    # 30 req/s of 1000 tokens, 10 output tokens each: 3 replicas of prompt load, 300 output tokens/s.
    # Averaged with the interval before, the first is (0.5 + 3) / 2 = 1.75 -> 2; the second, 3 -> 4.
    burst = run(p, [30] * 4, (1, 1), start_s=210, output_tokens=10)
    assert prefill_targets(burst) == [2, 4, 4, 4]
    assert [d.targets["decode"] for d in burst] == [1, 1, 1, 1]
    assert burst[0].reasons["prefill"].startswith("up to 2 for 30000 prompt tokens/s")
    assert burst[-1].needed == {"prefill": 4, "decode": 1}


def test_long_outputs_grow_decode_only():
    p = planner()
    run(p, [5] * 6, (1, 1))
    # 5 req/s of 1000 output tokens, the first of each out of its prefill: 4,995 decoded tokens/s over
    # 799 -> 7; the first interval, averaged with the 245 tokens/s before, is 2,620 / 796 -> 4.
    longer = run(p, [5] * 3, (1, 1), start_s=210, output_tokens=1000)
    assert [dict(d.targets) for d in longer] == [{"prefill": 1, "decode": 4}, {"prefill": 1, "decode": 7}, {"prefill": 1, "decode": 7}]
    assert longer[1].reasons["decode"].startswith("up to 7 for 4995 output tokens/s at 799 per replica (batch 76)")


def test_the_decode_pool_keeps_room_for_its_sequences_swing_together_not_each_its_own():
    """5,550 decoded tokens/s (5 req/s of 1,111 tokens): 7.1 replicas at the 780 tokens/s of a
    replica keeping room for its own swing, but 6.95 in a pool of 7 (799 each), which the router
    balances as one batch (each sequence joins the smallest): 7 replicas, not 8."""
    batch, rate = planner().sizer.decode_rate(0.1, 7)
    assert batch + 1.6448536 * math.sqrt(batch / 7) == pytest.approx(81, abs=1e-4)
    targets = {}
    for pooled in (True, False):
        decision = planner(decode_swing_pooled=pooled, **ALONE).decide(observe(30, 5, output_tokens=1111), pools(1, 1))
        targets[pooled] = decision.targets["decode"]
    assert targets == {True: 7, False: 8} and 5550 / rate < 7 < 5550 / planner().sizer.decode_rate(0.1)[1]
    assert decision.reasons["decode"].startswith("up to 8 for 5550 output tokens/s at 780 per replica (batch 67)")


def test_first_tokens_come_out_of_prefill_and_are_no_decode_load():
    """A one-token answer's only token comes out of its prefill: 2,000 req/s of them stream 2,000
    tokens/s (three decode replicas' worth at 780 each, were they decode work) and decode stays at 1."""
    p = planner(max_prefill=400)
    decisions = run(p, [60, 2000, 2000], (1, 1), prompt_tokens=10, output_tokens=1)
    assert [d.targets["decode"] for d in decisions] == [1, 1, 1]
    assert decisions[-1].reasons["decode"].startswith("holding at 1 for 0 output tokens/s")


def test_an_itl_over_the_slo_for_a_start_up_sizes_decode_for_the_interval_not_its_average():
    """Output rises to 1000 tokens a request, then 2000: averaged with the interval before, the two
    intervals need 4 and 10 decode replicas ((245 + 4,995) / 2 / 796 and (4,995 + 9,995) / 2 / 801).
    An ITL p90 over the SLO in both (each interval of a 60 s start-up) means the batch has been over
    what it allows for as long as a replica takes to start: the second gets the 13 its own load needs
    (9,995 / 802).
    Over in one interval only, or in two with a good one between, is a burst the pool rides out."""
    plans = {name: planner() for name in ("calm", "late", "once", "broken")}
    for p in plans.values():
        run(p, [5] * 6, (1, 1))
    itl = {"calm": (0.09, 0.09), "late": (0.15, 0.15), "once": (0.09, 0.15), "broken": (0.15, 0.09)}
    last = {}
    for name, p in plans.items():
        first = p.decide(observe(210, 5, output_tokens=1000, itl_s_p90=itl[name][0]), pools(1, 1))
        assert first.targets["decode"] == 4  # never chased on one interval
        last[name] = p.decide(observe(240, 5, output_tokens=2000, itl_s_p90=itl[name][1]), pools(1, 4))
    assert {name: d.targets["decode"] for name, d in last.items()} == {"calm": 10, "late": 13, "once": 10, "broken": 10}
    assert "the ITL p90 0.150 s is over the SLO, 2 intervals running" in last["late"].reasons["decode"]
    # Then 2400 tokens a request, over the SLO again: 14 on the average, 15 on its own load. The good
    # interval between restarted the count, so "broken" is not chased; "late" is, three running.
    third = {name: plans[name].decide(observe(270, 5, output_tokens=2400, itl_s_p90=0.15), pools(1, last[name].targets["decode"])) for name in ("late", "broken")}
    assert {name: d.targets["decode"] for name, d in third.items()} == {"late": 15, "broken": 14}


def test_a_stalled_batch_grows_decode_now_but_is_not_remembered_as_load():
    """700 sequences in the decode batch at 210 s, 300 of them streaming 400 tokens a second. As
    load (no prompts queued on the decode replicas), they need 5 replicas averaged over the
    start-up, and the 600 s window holds 5 until they leave it at 810 s. Piled up behind batches
    stalled while their replicas prefill a queue of their own prompts, they are a backlog: the pool
    grows to the 10 they need now (700 at a batch of 76.5), and once the cooldown and warm-up allow, goes back to the 1 the
    window's load needs."""
    targets = {}
    for name, queued in (("stalled", 50_000), ("load", 0)):
        p = planner(**REMEMBER, base_window_s=600.0, rise_start_ups=0)
        run(p, [5] * 6, (1, 1))
        first = p.decide(observe(210, 5, output_tokens=80, decode_running=700, decode_queued_prefill_tokens=queued, queued_prefill_tokens=queued), pools(1, 1))
        later = run(p, [5] * 20, (1, first.targets["decode"]), start_s=240, decode_running=10)
        targets[name] = [first.targets["decode"]] + [d.targets["decode"] for d in later]
        if name == "stalled":
            assert first.reasons["decode"].endswith("; 700 sequences in a stalled batch")
    times = [210] + list(range(240, 840, 30))
    at = lambda name, t: targets[name][times.index(t)]  # noqa: E731
    assert (at("stalled", 210), at("load", 210)) == (10, 5)
    assert (at("stalled", 600), at("load", 600)) == (1, 5)  # the warm-up (600 s) over: the backlog is not held
    assert at("load", 780) == 5 and at("load", 810) == 1  # the load is, for the window


def test_prompts_queued_behind_a_prefill_backlog_grow_decode_for_the_sequences_they_will_be():
    """300,000 prompt tokens queued at one prefill replica (30 s of its work, past the 1.9 s slack):
    300 prompts of 1,000 tokens on their way to the decode pool, which has 130 sequences running.
    The 430 need 6 replicas (430 / 75.2 a replica in a pool of 6); the 130 alone, 2 (130 / 71.2).
    Without a backlog (18 prompts queued are 1.8 s of work: 148 sequences would need 3), and for
    prompts queued on the decode replicas themselves (a stalled batch's, the prefill pool empty),
    only the running ones count."""
    def decode_target(**fields):
        return planner(**ALONE).decide(observe(30, 5, decode_running=130, **fields), pools(1, 1))
    behind = decode_target(queued_prefill_tokens=300_000)
    assert behind.targets["decode"] == 6
    assert behind.reasons["decode"].endswith("; 130 sequences running and 300 prompts queued for prefill behind its backlog")
    assert decode_target(queued_prefill_tokens=18_000).targets["decode"] == 2
    assert decode_target().targets["decode"] == 2
    on_decode = decode_target(queued_prefill_tokens=300_000, decode_queued_prefill_tokens=300_000)
    assert on_decode.targets["decode"] == 2 and "prompts queued for prefill" not in on_decode.reasons["decode"]


def test_a_burst_shorter_than_a_start_up_is_averaged_down_and_not_chased():
    p = planner()
    run(p, [5] * 6, (1, 1))
    # One interval at 30 req/s: averaged over a start-up (two intervals) it is 1.75 replicas -> 2,
    # not the 4 that 3 replicas of load would need; the interval after it averages to 1.75 again.
    spike = run(p, [30, 5, 5], (1, 1), start_s=210, output_tokens=10)
    assert prefill_targets(spike) == [2, 2, 2]
    assert spike[0].needed["prefill"] == 2
    # The spike holds 900 of the window's 2,700 requests: its count is the window's 0.95 quantile.
    assert spike[2].reasons["prefill"].endswith("the window's 0.95 quantile needs 2")


def test_the_window_remembers_a_burst_and_shrinks_once_it_has_passed():
    p = planner(**REMEMBER, base_window_s=150, scale_down_cooldown_s=0)  # five intervals
    decisions = run(p, [30, 30] + [5] * 7, (1, 1))
    # 4 while an interval at 30 req/s is in the window (to t=180; the one ending at 60 s leaves it at
    # 210 s); then the 1.75 replicas averaged at 90 s need 3 at the 0.8 margin (2.19); then 1.
    assert prefill_targets(decisions) == [4, 4, 4, 4, 4, 4, 3, 1, 1]
    assert decisions[2].reasons["prefill"] == "holding at 4 for 5000 prompt tokens/s, 1000 a prompt at 0.100 s each; the window's 0.95 quantile needs 4"
    assert decisions[6].needed["prefill"] == 2 and decisions[6].reasons["prefill"].startswith("down to 3 for 5000 prompt tokens/s")


def test_a_level_held_longer_than_a_burst_is_let_go_once_over_but_a_train_of_bursts_is_remembered():
    """A 600 s window (20 intervals, so k = 3 and a level is (3 + 3) start-ups = 360 s). After 600 s at
    5 req/s (one prefill replica), the load goes to 30 req/s (four). A level of 16 intervals (480 s)
    followed by two start-ups the one replica carries is let go: back to 1 at 1230 s, where the
    window alone holds 4 until the level has left it. Bursts of three intervals, five start-ups
    apart, keep the pool above 1 for as long, but each is a burst: the window remembers them."""
    def prefill_at(rates, **fields):
        p = planner(**REMEMBER, base_window_s=600.0, rise_start_ups=0, scale_down_cooldown_s=0, **fields)
        run(p, [5] * 20, (1, 1))
        decisions = run(p, rates, (1, 1), start_s=630, output_tokens=10)
        return {630 + 30 * i: d for i, d in enumerate(decisions)}

    level = [30] * 16 + [5] * 20
    released, kept = prefill_at(level), prefill_at(level, release_level_after_s=math.inf)
    assert [released[t].targets["prefill"] for t in (630, 660, 1080, 1110, 1200)] == [2, 4, 4, 4, 4]
    assert released[1230].targets["prefill"] == 1
    assert released[1230].reasons["prefill"].startswith("down to 1 for 5000 prompt tokens/s")
    assert "; the level of 8 minutes is over, 1 carried the last 4 intervals" in released[1230].reasons["prefill"]
    assert all(released[t].targets["prefill"] == 1 for t in range(1230, 1710, 30))
    assert all(kept[t].targets["prefill"] == 4 for t in range(660, 1680, 30))  # the 1080 s interval leaves at 1680 s

    train = prefill_at(([30] * 3 + [5] * 7) * 4 + [5] * 4)
    assert all(train[t].targets["prefill"] == 4 for t in range(660, 1590, 30))
    assert not any("is over" in d.reasons["prefill"] for d in train.values())


def test_a_level_is_timed_from_where_the_load_left_the_pools_count_not_from_when_it_grew():
    """Two prefill replicas carry 10 req/s (1.0 replica of load: 2 to grow, 2 at the 0.8 margin).
    At 17.5 req/s (1.75: still 2 to grow, 3 at the margin) the pool holds but the load is no longer
    within its count; 30 req/s (3.0) grows it to 4. The run of 8 + 4 intervals is a level (over
    360 s) although the pool grew for only the last 4: once 10 req/s has lasted two start-ups, the
    pool is back at 2."""
    p = planner(**REMEMBER, base_window_s=600.0, rise_start_ups=0, scale_down_cooldown_s=0)
    run(p, [10] * 20, (2, 1))
    decisions = run(p, [17.5] * 8 + [30] * 4 + [10] * 10, (2, 1), start_s=630, output_tokens=10)
    targets = [d.targets["prefill"] for d in decisions]
    assert targets[:8] == [2] * 8 and targets[8:12] == [3, 4, 4, 4]
    assert targets[12:16] == [4] * 4 and targets[16:] == [2] * 6
    assert decisions[16].reasons["prefill"].endswith("; the level of 6 minutes is over, 2 carried the last 4 intervals")


def test_a_level_let_go_is_forgotten_by_both_pools():
    """A crowd of 30 req/s with 35-token answers (about 1,000 decoded tokens/s: 2 decode replicas of
    780 tokens/s) comes after 450 s at 5 req/s (170 tokens/s: 1). The decode pool was deployed at 2
    and the warm-up (600 s) held it there, so the crowd grows only prefill. Once the prefill pool's
    level is let go, the window forgets the crowd's intervals for decode too: it goes to 1 at once
    instead of holding 2 until the crowd has left the window (the 930 s interval, at 1530 s)."""
    def decode_at(**fields):
        p = planner(base_window_s=600.0, rise_start_ups=0, scale_down_cooldown_s=0, **fields)
        decisions = run(p, [5] * 15 + [30] * 16 + [5] * 20, (1, 2), output_tokens=35)
        return {30 + 30 * i: d for i, d in enumerate(decisions)}

    released, kept = decode_at(), decode_at(release_level_after_s=math.inf)
    assert all(released[t].targets["decode"] == 2 for t in range(30, 1080, 30))
    assert "the level of 8 minutes is over" in released[1080].reasons["prefill"]
    assert [released[t].targets[pool] for t in (1080, 1200) for pool in ("prefill", "decode")] == [1, 1, 1, 1]
    assert all(kept[t].targets["decode"] == 2 for t in range(30, 1530, 30)) and kept[1530].targets["decode"] == 1


def test_a_level_leaves_the_window_with_the_start_up_either_side_that_its_average_spreads_into():
    """Prefill deployed at 2, held there by the warm-up (a 900 s window) through a crowd that starts
    with one interval at 15 req/s. That interval, averaged with the one before (1.0 replica of load),
    is within the 2 the pool had, so the level's run begins after it; its 450 requests at a count of
    2 would hold the window's 0.95 quantile at 2 once the crowd is let go. It spreads the level's
    load, and leaves the window with it: the pool goes to the 1 that 5 req/s needs."""
    p = planner(**REMEMBER, base_window_s=900.0, rise_start_ups=0, scale_down_cooldown_s=0)
    decisions = run(p, [5] * 15 + [15] + [30] * 16 + [5] * 20, (2, 1), output_tokens=10)
    at = {30 + 30 * i: d.targets["prefill"] for i, d in enumerate(decisions)}
    released = next(t for t, d in zip(at, decisions) if "is over" in d.reasons["prefill"])
    assert at[released - 30] == 4 and at[released] == 1 and set(at[t] for t in at if t > released) == {1}


def test_a_level_on_top_of_a_level_is_let_go_first_and_the_one_below_after_it():
    """A 900 s window (k = 4, a level is 7 start-ups). After 900 s at 5 req/s (one prefill replica),
    12.5 req/s (1.25 replicas of load: 2, and 2 at the margin) for 16 intervals grow the pool to 2
    and it settles there; 30 req/s for 16 more grow it to 4, a level of its own. Back at 12.5 req/s,
    the upper level is let go (2); back at 5, the lower one, which began at 930 s, is let go too (1)
    rather than held until it leaves the window."""
    p = planner(base_window_s=900.0, rise_start_ups=0, scale_down_cooldown_s=0)
    run(p, [5] * 30, (1, 1))
    decisions = run(p, [12.5] * 16 + [30] * 16 + [12.5] * 6 + [5] * 10, (1, 1), start_s=930, output_tokens=10)
    at = {930 + 30 * i: d for i, d in enumerate(decisions)}
    over = [(t, d.reasons["prefill"]) for t, d in at.items() if "is over" in d.reasons["prefill"]]
    assert [t for t, _ in over] == [2010, 2190]
    assert over[0][1].endswith("the level of 8 minutes is over, 2 carried the last 4 intervals")
    assert over[1][1].endswith("the level of 20 minutes is over, 1 carried the last 4 intervals")
    assert [at[t].targets["prefill"] for t in (1380, 1860, 2010, 2160, 2190, 2340)] == [2, 4, 2, 2, 1, 1]


def test_release_level_after_s_is_derived_from_the_trend_test_or_set():
    assert planner().window.level_s == (4 + 3) * 60.0  # the default window: k = 4, two intervals a start-up
    assert planner(base_window_s=600.0).window.level_s == (3 + 3) * 60.0
    assert planner(release_level_after_s=90.0).window.level_s == 90.0
    with pytest.raises(ValueError, match="release_level_after_s must be 0 or more"):
        PlannerConfig(release_level_after_s=-1.0)
    with pytest.raises(ValueError, match="release_level_after_s must be 0 or more"):
        PlannerConfig(release_level_after_s=math.nan)


def test_no_pool_shrinks_before_a_full_window_has_been_observed():
    p = planner(**REMEMBER, base_window_s=150, scale_down_cooldown_s=0)
    decisions = run(p, [5] * 6, (4, 1))  # a planner restarted on a pool larger than the load needs
    assert prefill_targets(decisions) == [4, 4, 4, 4, 1, 1]
    assert [d.needed["prefill"] for d in decisions] == [1] * 6
    assert decisions[0].reasons["prefill"] == "holding at 4: 30 s of the 150 s window observed, too few to shrink on"
    assert decisions[3].reasons["prefill"] == "holding at 4: 120 s of the 150 s window observed, too few to shrink on"
    assert decisions[4].reasons["prefill"].startswith("down to 1 for 5000 prompt tokens/s")


def test_hysteresis_and_cooldown_hold_a_pool_until_the_lower_count_is_comfortably_enough():
    p = planner(scale_down_cooldown_s=300, **ALONE, **REMEMBER)  # the cooldown above the deployment too
    assert p.decide(observe(30, 30), pools(1, 1)).targets["prefill"] == 4
    # 17 req/s: 1.7 replicas of load -> 2 needed, but 1.7 / 0.8 margin -> 3 kept; not before the cooldown
    decision = p.decide(observe(60, 17), pools(4, 1))
    assert decision.targets["prefill"] == 4 and decision.reasons["prefill"] == "holding at 4: cooling down since the change at 30 s"
    decision = p.decide(observe(400, 17), pools(4, 1))
    assert decision.targets["prefill"] == 3 and decision.needed["prefill"] == 2
    decision = p.decide(observe(430, 5), pools(3, 1))
    assert decision.targets["prefill"] == 3 and decision.reasons["prefill"] == "holding at 3: cooling down since the change at 400 s"
    assert p.decide(observe(700, 5), pools(3, 1)).targets["prefill"] == 1


def test_the_decode_pool_shrinks_to_its_count_and_the_prefill_pool_keeps_its_margin():
    # 2,000 decoded tokens/s (10 req/s, 201 tokens each, the first from prefill) is 2.56 replicas -> 3;
    # then 1,400 is 1.79 -> 2, which decode shrinks to at once (its default margin is 1), while
    # 0.8 of the prefill pool's 1.0 replica of load would be 1.25 -> it keeps 2 of them.
    p = planner(scale_down_cooldown_s=0, **ALONE)
    first = p.decide(observe(30, 10, output_tokens=201), pools(1, 1))
    assert (first.targets["prefill"], first.targets["decode"]) == (2, 3)
    second = p.decide(observe(60, 10, output_tokens=141), pools(2, 3))
    assert second.targets["decode"] == 2 and second.reasons["decode"].startswith("down to 2 for 1400 output tokens/s")
    assert p.decide(observe(90, 8), pools(2, 2)).targets["prefill"] == 2  # 0.8 replicas of prompts: 1 needed, 2 kept
    # At the prefill pool's 0.8, decode's 1.79 / 0.8 = 2.24 replicas would keep the 3.
    banded = planner(scale_down_cooldown_s=0, decode_scale_down_margin=0.8, **ALONE)
    banded.decide(observe(30, 10, output_tokens=201), pools(1, 1))
    assert banded.decide(observe(60, 10, output_tokens=141), pools(2, 3)).targets["decode"] == 3


def test_load_hovering_at_a_boundary_does_not_flap():
    p = planner(scale_down_cooldown_s=0, **ALONE)
    # 0.8 / 0.9 replicas of prompt load need 1 / 2; shrinking to 1 needs 0.8 / 0.8 = 1.0 -> 2.
    assert prefill_targets(run(p, [8, 9, 8, 9, 8, 9, 8], (1, 1))) == [1, 2, 2, 2, 2, 2, 2]


def test_a_stabilisation_window_shrinks_only_to_the_most_any_interval_within_it_needed():
    def targets_and_reasons(window_s: float) -> list[tuple[int, str]]:
        p = planner(scale_down_cooldown_s=0, scale_down_window_s=window_s, **ALONE)
        return [(d.targets["prefill"], d.reasons["prefill"]) for d in run(p, [30, 17, 30, 17, 5, 5, 5, 5], (1, 1))]

    assert [t for t, _ in targets_and_reasons(0)] == [4, 3, 4, 3, 1, 1, 1, 1]  # each dip taken at once: three direction changes
    held = targets_and_reasons(90)
    assert [t for t, _ in held] == [4, 4, 4, 4, 4, 3, 1, 1]
    assert held[1][1] == held[4][1] == "holding at 4: needed within the last 90 s"
    assert held[5][1].startswith("down to 3, the most the last 90 s needed, for 5000 prompt tokens/s")
    with pytest.raises(ValueError, match="scale_down_window_s must be 0 or more"):
        PlannerConfig(scale_down_window_s=-1)


def test_starting_replicas_are_not_capacity_and_are_not_asked_for_twice():
    p = planner(scale_down_cooldown_s=0, **ALONE)
    p.decide(observe(30, 30), pools(1, 1))
    decision = p.decide(observe(60, 30), pools(1, 1, prefill_starting=3))
    assert decision.targets["prefill"] == 4  # 1 ready + 3 starting cover the 4 needed: none added
    decision = p.decide(observe(90, 5), pools(1, 1, prefill_starting=3))
    assert decision.targets["prefill"] == 4 and decision.reasons["prefill"] == "holding at 4: 3 replicas still starting"


def test_a_missed_slo_holds_a_pool_that_would_shrink():
    p = planner(scale_down_cooldown_s=0, **ALONE)
    p.decide(observe(30, 30), pools(1, 1))
    decision = p.decide(observe(60, 5, ttft_s_p90=2.5), pools(4, 1))
    assert decision.targets["prefill"] == 4 and decision.reasons["prefill"] == "holding at 4: the SLO was missed last interval"
    assert p.decide(observe(90, 5, ttft_s_p90=1.0), pools(4, 1)).targets["prefill"] == 1


def test_an_interval_with_more_requests_weighs_more_in_the_windows_quantile():
    # A window of ten intervals and its 0.9 quantile: with every interval weighed alike, one busy
    # interval in ten would be the 10% the quantile leaves out.
    p = planner(**REMEMBER, base_quantile=0.9, base_window_s=300, scale_down_cooldown_s=0, startup_s=30.0)
    decisions = run(p, [5] * 9 + [30] + [5] * 9, (1, 1), output_tokens=10)
    # Its 900 requests are 40% of the window's 2,250: its 4 replicas are the quantile until it leaves.
    assert prefill_targets(decisions) == [1] * 9 + [4] * 10
    assert decisions[-1].needed["prefill"] == 4 and decisions[-1].reasons["prefill"].endswith("the window's 0.9 quantile needs 4")
    # Two quiet intervals of long prompts (1 req/s of 15,000 tokens: 1.5 replicas of load at 0.8 s and
    # 1.15 s a prompt) need 3 and 4 each; a fifth of the window's intervals, but 60 of its 1,260
    # requests (4.8%), so the quantile leaves them out.
    p = planner(**REMEMBER, base_quantile=0.9, base_window_s=300, scale_down_cooldown_s=0, startup_s=30.0)
    run(p, [5] * 8, (1, 1), output_tokens=10)
    quiet = run(p, [1, 1], (1, 1), start_s=270, prompt_tokens=15000, output_tokens=10)
    assert [d.needed["prefill"] for d in quiet] == [1, 1] and prefill_targets(quiet) == [1, 1]


def test_prompts_too_long_for_the_slo_are_counted_apart_and_do_not_drive_prefill_to_max():
    p = planner(max_prefill=8)
    # 900 requests: 895 of 512 to 1024 tokens and 5 past 20,000, the longest prompt within 2 s.
    buckets = ((512.0, 0), (1024.0, 895), (20000.0, 0), (40000.0, 5), (math.inf, 0))
    tokens = 895 * 1000 + 5 * 30000
    for t in (30, 60, 90):
        decision = p.decide(Observation(t, INTERVAL_S, 900, tokens, 900 * 10, prompt_length_counts=buckets), pools(1, 1))
        assert decision.infeasible_requests == 5 and decision.infeasible == ()
        assert 0 < decision.targets["prefill"] < 8
        assert decision.reasons["prefill"].endswith("(5 requests had prompts no replica prefills within the TTFT SLO)")
    quiet = p.decide(observe(120, 5), pools(1, 1))
    assert quiet.infeasible_requests == 0 and "TTFT SLO" not in quiet.reasons["prefill"]


def test_prompts_too_long_for_the_slo_count_in_the_load_only_beside_prompts_to_keep_from_waiting():
    def observed(t, short, long):  # per interval: short prompts of 1000 tokens, long ones of 30,000 (3 s each)
        buckets = ((512.0, 0), (1024.0, short), (20000.0, 0), (40000.0, long), (math.inf, 0))
        return Observation(t, INTERVAL_S, short + long, short * 1000 + long * 30000, (short + long) * 10, prompt_length_counts=buckets)

    # Only long prompts, 4 a second: 12 replicas of prefill work, every second of it late whatever the
    # count. Nothing else waits behind them, so their work is left out and never grows the pool; nor
    # does the KV they fill grow decode (a replica more would hold more of them, none in time).
    p = planner(max_prefill=8)
    for t in (30, 60, 90, 120):
        decision = p.decide(dataclasses.replace(observed(t, 0, 120), kv_usage=2.5), pools(1, 1))
        assert decision.needed["prefill"] == 0 and decision.targets["prefill"] == 1  # held by the warm-up, not grown
        assert decision.infeasible == () and decision.infeasible_requests == 120
        assert decision.targets["decode"] == 1 and "filled by prompts no replica prefills within the TTFT SLO: not grown for" in decision.reasons["decode"]
    # Beside 10 short prompts a second (one replica of load, 2 replicas alone), one long prompt a second
    # holds about 3 replicas the short ones would otherwise wait for: its work counts.
    p = planner(max_prefill=8)
    for t in (30, 60, 90):
        decision = p.decide(observed(t, 300, 30), pools(1, 1))
    assert decision.targets["prefill"] >= 5 and decision.infeasible_requests == 30
    assert "left out" not in decision.reasons["prefill"]
    # There the KV use they fill grows decode as any does.
    decision = p.decide(dataclasses.replace(observed(120, 300, 30), kv_usage=0.95), pools(decision.targets["prefill"], 1))
    assert decision.targets["decode"] == 2 and decision.reasons["decode"].endswith("KV use 0.95 is over 0.9")


def test_an_idle_stretch_keeps_what_the_traffic_before_it_needed_for_idle_hold_s():
    # 3 replicas of prompt load need 4; then no request at all for 40 minutes, eight windows of 300 s.
    def idle_after_burst(deployed, **fields):
        p = planner(base_window_s=300, scale_down_cooldown_s=0, **fields)
        assert prefill_targets(run(p, [30] * 12, (deployed, 1), output_tokens=10))[-1] == 4
        return run(p, [0] * 80, (4, 1), start_s=390)

    held = idle_after_burst(4)  # the default holds an hour of idleness
    assert prefill_targets(held) == [4] * 80
    assert held[-1].reasons["prefill"].endswith("no request for 2400 s: the window keeps the traffic before it for up to 3600 s idle")
    aged = idle_after_burst(4, idle_hold_s=0)  # idle time ages the window: it forgets the burst a window later
    assert prefill_targets(aged)[-1] == 0 and 4 not in prefill_targets(aged)[12:]
    later = idle_after_burst(4, idle_hold_s=600)  # held for 600 s idle, then aged as any other time
    assert prefill_targets(later)[:20] == [4] * 20 and prefill_targets(later)[-1] == 0
    # What was above the deployment goes as it would with traffic: idleness keeps memory only up to it.
    assert prefill_targets(idle_after_burst(1))[4:] == [1] * 76


def test_a_deployment_that_starts_idle_keeps_its_pools_until_traffic_has_been_observed():
    # No request for 20 minutes: the warm-up (a 300 s window here) counts only observed traffic.
    assert set(prefill_targets(run(planner(base_window_s=300), [0] * 40, (3, 2)))) == {3}
    assert prefill_targets(run(planner(base_window_s=300, idle_hold_s=0), [0] * 40, (3, 2)))[-1] == 0


def test_above_the_deployment_a_pool_holds_only_what_the_last_two_start_ups_needed():
    # Deployed at 1 + 1: a two-minute burst of 3 replicas of prompt load grows prefill to 4 in the
    # warm-up. Once the last two start-ups no longer need them, the replicas above the deployment go,
    # within the warm-up and without waiting out the 300 s cooldown since the pool grew.
    burst = [5] * 4 + [30] * 4 + [5] * 24
    decisions = run(planner(), burst, (1, 1))
    assert prefill_targets(decisions)[:12] == [1, 1, 1, 1, 2, 4, 4, 4, 4, 4, 4, 3] and set(prefill_targets(decisions)[12:]) == {1}
    assert decisions[12].reasons["prefill"].endswith("above the deployment's 1, only what the last two start-ups needed")
    # With the window's memory above the deployment, the warm-up and the window hold the burst's 4.
    assert set(prefill_targets(run(planner(**REMEMBER), burst, (1, 1)))[5:]) == {4}


def test_up_to_the_deployment_the_window_still_remembers_a_burst():
    # Deployed at 4: the quiet load takes it to 1 after the warm-up, which holds the deployment's 4
    # and says so; a burst back to 4 is remembered.
    decisions = run(planner(base_window_s=600, scale_down_cooldown_s=0), [5] * 24 + [30] * 4 + [5] * 16, (4, 1))
    targets = prefill_targets(decisions)
    assert targets[:19] == [4] * 19 and decisions[5].reasons["prefill"] == "holding at 4: 180 s of the 600 s window observed, too few to shrink on"
    assert targets[19:24] == [1] * 5 and targets[25:] == [4] * 19


RIDE_OUT = {"burst_growth_above_deployment": False}
"""The default: above the deployment a pool grows only for a shift or on savings."""
WINDOWED = {**RIDE_OUT, "error_budget_extrapolated": False}
"""The error budget of the requests seen alone, however little of its window has been watched."""


def test_above_the_deployment_a_burst_is_ridden_out_and_a_shift_grows_the_pool():
    # Deployed at 1 + 1. A 90 s burst of 3 replicas of prompt load: its counts, averaged over a
    # start-up, stay above 1 for two start-ups, but by then this interval alone needs 1 again.
    burst = [5] * 4 + [30] * 3 + [5] * 8
    decisions = run(planner(**RIDE_OUT), burst, (1, 1))
    assert set(prefill_targets(decisions)) == {1}
    assert decisions[5].reasons["prefill"].endswith(
        "held at 1 for 4: above the deployment's 1 a pool grows for load that needed more over the last two start-ups, or on savings (0 replica-seconds, 270 needed)"
    )
    assert max(prefill_targets(run(planner(), burst, (1, 1)))) == 4  # growing for any load
    # The same load held on is a shift: the pool grows once two start-ups needed more and this interval still does.
    assert prefill_targets(run(planner(**RIDE_OUT), [5] * 4 + [30] * 8, (1, 1))) == [1] * 7 + [4] * 5


def test_above_the_deployment_a_shift_grows_the_pool_only_once_the_slos_error_budget_is_spent():
    # Deployed at 1 + 1: the shift above grows prefill to 4 after two start-ups (the 8th interval),
    # when nothing counts the requests that missed an SLO. Counted, and none missing, the deployment
    # serves it within the attainment target: held at 1 throughout, and the reason says why.
    shift = [5] * 4 + [30] * 8
    misses = lambda per_overloaded: [0] * 4 + [per_overloaded] * 8  # noqa: E731
    counted = lambda p, m: decide_each(p, [observe(30.0 * (i + 1), rate, slo_misses=n) for i, (rate, n) in enumerate(zip(shift, m))], (1, 1))  # noqa: E731
    decisions = counted(planner(**WINDOWED), misses(0))
    assert set(prefill_targets(decisions)) == {1}
    assert decisions[7].reasons["prefill"].endswith("a shift, but the SLO's error budget is not spent: 210 more requests of the last 3600 s may miss (0.05 of them)")
    assert decisions[-1].error_budget == pytest.approx(0.05 * (4 * 150 + 8 * 900))
    # 60 of each overloaded interval's 900 requests miss: 30 + 45 k - 60 k requests are left after
    # k of them, spent in the 2nd; the shift grows the pool when it is one (the 8th interval).
    decisions = counted(planner(**WINDOWED), misses(60))
    assert prefill_targets(decisions) == [1] * 7 + [4] * 5 and decisions[7].error_budget == pytest.approx(30 - 15 * 4)
    # 36 of them: 30 + 9 k, never spent within the hour, the shift held through.
    assert set(prefill_targets(counted(planner(**WINDOWED), misses(36)))) == {1}
    # A prompt no replica prefills within the TTFT SLO (here 10 of 150, past 32k tokens) misses it
    # whatever the pool does: counted apart, its miss spends nothing.
    lengths = ((1024.0, 140), (2.0 ** 15, 0), (math.inf, 10))
    assert planner(**WINDOWED).decide(observe(30.0, 5, slo_misses=10, prompt_length_counts=lengths), pools(1, 1)).error_budget == pytest.approx(7.5)
    assert planner(**WINDOWED).decide(observe(30.0, 5, slo_misses=10), pools(1, 1)).error_budget == pytest.approx(7.5 - 10)
    # Off, or with no count of misses, the shift grows as before.
    assert prefill_targets(counted(planner(**WINDOWED, error_budget_above_deployment=False), misses(0))) == [1] * 7 + [4] * 5
    assert prefill_targets(run(planner(**WINDOWED), shift, (1, 1))) == [1] * 7 + [4] * 5
    # The default counts the window at the rate seen so far: 240 s watched of 3600, the 4,200
    # requests are 63,000 an hour, and 240 misses leave 2,910 of its 3,150: the shift is held.
    decisions = counted(planner(**RIDE_OUT), misses(60))
    assert set(prefill_targets(decisions)) == {1} and decisions[7].error_budget == pytest.approx(0.05 * 4200 * 3600 / 240 - 240)
    # The budget counts its window alone: with 120 s, the quiet intervals' share is gone by the 8th.
    decisions = counted(planner(**WINDOWED, error_budget_window_s=120.0), misses(60))
    assert decisions[7].error_budget == pytest.approx(0.05 * 4 * 900 - 4 * 60)


def test_above_the_deployment_a_full_kv_pool_grows_decode_only_once_the_error_budget_is_spent():
    # Deployed at 1 + 1, 5 req/s (150 an interval): KV use over 0.9 asks for a second decode
    # replica. With none of the requests missing an SLO, the deployment's 1 holds; once more than
    # 0.05 of them have missed (8 of 150 in the first interval), it grows at once.
    full = lambda misses: observe(30.0, 5, kv_usage=0.95, slo_misses=misses)  # noqa: E731
    held = planner(**WINDOWED).decide(full(0), pools(1, 1))
    assert held.targets["decode"] == 1 and held.held_at_deployment == ("decode",)
    assert held.reasons["decode"].endswith(
        "KV use 0.95 is over 0.9, but above the deployment's 1 the SLO's error budget is not spent: 8 more requests of the last 3600 s may miss (0.05 of them)"
    )
    grown = planner(**WINDOWED).decide(full(8), pools(1, 1))
    assert grown.targets["decode"] == 2 and grown.reasons["decode"].endswith("KV use 0.95 is over 0.9")
    # With nothing counting the misses, or the budget off, it grows as before.
    assert planner(**WINDOWED).decide(observe(30.0, 5, kv_usage=0.95), pools(1, 1)).targets["decode"] == 2
    assert planner(**WINDOWED, error_budget_above_deployment=False).decide(full(0), pools(1, 1)).targets["decode"] == 2


def test_until_a_whole_window_is_watched_the_error_budget_counts_it_at_the_rate_seen():
    # 150 requests an interval of 30 s, 20 of them missing: after k intervals the hour holds 18,000
    # at that rate, 900 of which may miss; 20 k have. With a window of 300 s watched whole after the
    # tenth interval, the budget is then that window's own: 0.05 x 1,500 - 200 = -125.
    def budgets(**fields):
        p = planner(**RIDE_OUT, **fields)
        return [p.decide(observe(30.0 * (i + 1), 5, slo_misses=20), pools(1, 1)).error_budget for i in range(12)]

    assert budgets() == pytest.approx([900 - 20 * k for k in range(1, 13)])
    assert budgets(error_budget_window_s=300.0) == pytest.approx([0.05 * 1500 - 20 * k for k in range(1, 11)] + [-125.0, -125.0])
    assert budgets(error_budget_extrapolated=False) == pytest.approx([(7.5 - 20) * k for k in range(1, 13)])


def test_replicas_saved_below_the_deployment_pay_for_growth_above_it():
    # Deployed at 4 with nothing saved: 6 replicas of prompt load (7 replicas) are held at 4.
    decisions = run(planner(**RIDE_OUT), [60] * 3, (4, 1))
    assert prefill_targets(decisions) == [4, 4, 4] and "held at 4 for 7" in decisions[0].reasons["prefill"]
    # After seven quiet intervals at 1, 3 replicas below the deployment (630 replica-seconds), the
    # burst's first interval affords two decode replicas above its deployment of 1 (180 for a
    # start-up and an interval); the next, prefill's 3 above 4 (270), and one more decode replica:
    # the pools grow at once. Each interval then pays for the replicas kept above the deployment:
    # 630 + 90 saved - 2 * 30 above; then 4 * 30 + 3 * 30 - 90 saved.
    decisions = run(planner(**RIDE_OUT, base_window_s=600, scale_down_cooldown_s=0), [5] * 26 + [60] * 3, (4, 1))
    assert prefill_targets(decisions)[18:] == [4, 1, 1, 1, 1, 1, 1, 1, 4, 7, 7]
    assert [d.targets["decode"] for d in decisions[25:]] == [1, 3, 4, 4]
    assert decisions[26].reasons["decode"].endswith("above the deployment's 1, 180 of the 630 replica-seconds saved below it paid")
    assert decisions[27].reasons["prefill"].endswith("above the deployment's 4, 270 of the 570 replica-seconds saved below it paid")
    assert [d.saved_replica_s for d in decisions[25:]] == [540, 630, 570, 390]


def test_replicas_above_the_deployment_on_savings_go_back_once_the_savings_are_spent():
    # As above, but the load stays at 60 and every interval counts its SLO misses (none), so the
    # error budget is never spent and no shift pays for itself: once the savings can no longer pay
    # an interval of the 3 prefill and 3 decode replicas above the deployment, both pools go back.
    steps = [5] * 26 + [60] * 14
    decisions = run(planner(**RIDE_OUT, base_window_s=600, scale_down_cooldown_s=0), steps, (4, 1), slo_misses=0)
    assert prefill_targets(decisions)[26:] == [4, 7, 7, 7] + [4] * 10
    assert [d.targets["decode"] for d in decisions[26:]] == [3, 4, 4, 4] + [1] * 10
    assert [d.saved_replica_s for d in decisions[27:31]] == [570, 390, 210, 30]
    assert "back to the deployment's 4: the 30 replica-seconds saved below it no longer pay for 3 above it; a shift, but the SLO's error budget is not spent" in decisions[30].reasons["prefill"]
    assert decisions[30].held_at_deployment == ("decode", "prefill")
    # Paid once, for a start-up and an interval, they stayed.
    once = run(planner(**RIDE_OUT, base_window_s=600, scale_down_cooldown_s=0, savings_pay_while_above=False), steps, (4, 1), slo_misses=0)
    assert prefill_targets(once)[27:] == [7] * 13 and [d.saved_replica_s for d in once[27:29]] == [90, 90]


def test_replicas_let_go_are_charged_their_drain_to_the_savings():
    # As above, deployed at 4 + 3, with 60 sequences running throughout. At 5 req/s (150 an
    # interval) a sequence decodes for 60 * 30 / 150 = 12 s (Little's law), and a decode replica let
    # go drains when the longest of its 20 ends: 12 s times the 20th harmonic number. The shrink to
    # 1 + 1 is charged two such drains at once. At 60 req/s a drain is 1 s times the 15th (of 4
    # replicas) or 20th (of 3) harmonic number, and growth on savings and going back count it.
    def decide(**fields):
        steps = [5] * 26 + [60] * 14
        p = planner(**RIDE_OUT, base_window_s=600, scale_down_cooldown_s=0, **fields)
        return decide_each(p, [observe(30.0 * (i + 1), r, slo_misses=0, decode_running=60) for i, r in enumerate(steps)], (4, 3))

    harmonic = lambda m: sum(1 / i for i in range(1, m + 1))  # noqa: E731
    decisions = decide()
    assert [(d.targets["prefill"], d.targets["decode"]) for d in decisions[18:21]] == [(4, 3), (1, 1), (1, 1)]
    assert decisions[19].saved_replica_s == pytest.approx(-2 * 12 * harmonic(20))
    assert decisions[20].saved_replica_s == pytest.approx(-2 * 12 * harmonic(20) + 150)
    grown = decisions[27].reasons["decode"]
    assert grown.endswith(f"above the deployment's 3, {90 + harmonic(20):.0f} of the {decisions[26].saved_replica_s:.0f} replica-seconds saved below it paid")
    back = [d for d in decisions[27:] if d.targets["decode"] == 3][0]
    assert f"no longer pay for 1 above it and their {harmonic(15):.0f} s drain" in back.reasons["decode"]
    assert min(d.saved_replica_s for d in decisions[20:]) >= 0  # the drains were paid for
    # Counting the targets alone, the shrink is free and the account ends overdrawn.
    uncounted = decide(savings_count_drains=False)
    assert uncounted[19].saved_replica_s == 0 and uncounted[-1].saved_replica_s < 0


def test_a_deployment_at_max_holds_there_and_is_flagged_whatever_the_savings():
    decisions = run(planner(**RIDE_OUT, max_prefill=2), [30] * 4, (2, 1))  # 3 replicas of prompt load need 4
    assert prefill_targets(decisions) == [2] * 4 and all(d.infeasible == ("prefill",) for d in decisions)
    assert all("held at" not in d.reasons["prefill"] and "paid" not in d.reasons["prefill"] for d in decisions)
    # Deployed at 2 under a max of 3, with 180 replica-seconds saved: 4 needed, but only the one
    # replica max allows is afforded (90, not 180).
    decisions = run(planner(**RIDE_OUT, max_prefill=3, base_window_s=600, scale_down_cooldown_s=0), [5] * 26 + [30] * 2, (2, 1))
    assert prefill_targets(decisions)[24:] == [1, 1, 2, 3] and decisions[26].saved_replica_s == 210
    assert decisions[27].reasons["prefill"].endswith("above the deployment's 2, 90 of the 180 replica-seconds saved below it paid: holding at max 3")


def test_a_level_the_deployment_held_a_pool_through_is_let_go_once_over():
    # Deployed at 2: twelve minutes of a load that needs 3 in two intervals of each three is never a
    # shift, so the pool is held at 2 throughout; it is a level, not a burst, and once the load is
    # back within 2 the window forgets it and the pool goes to the 1 the quiet load needs.
    decisions = run(planner(**RIDE_OUT, base_window_s=600, scale_down_cooldown_s=0), [30, 10, 10] * 8 + [5] * 16, (2, 1))
    assert prefill_targets(decisions) == [2] * 26 + [1] * 14
    assert all("held at 2" in d.reasons["prefill"] for d in decisions[4:24])
    assert "prefill" in decisions[26].released_levels and "the level of 12 minutes is over" in decisions[26].reasons["prefill"]


def test_below_the_deployment_a_rise_is_met_at_twice_its_step_up_to_the_deployment():
    # Deployed at 6, the pool at 1 after the warm-up: 30 req/s needs 2 (averaged with the quiet
    # interval before), then 4; the pool asks for 3, then 5, twice each step (with no room kept for
    # rises and no rise met ahead, which would add to the second).
    rise = [5] * 26 + [30] * 2
    stepped = {"base_window_s": 600, "scale_down_cooldown_s": 0, "rise_room_below_deployment": False, "rise_ahead_below_deployment": False}
    decisions = run(planner(**stepped), rise, (6, 1))
    assert prefill_targets(decisions)[24:] == [1, 1, 3, 5]
    assert decisions[26].reasons["prefill"].startswith("up to 3, 2 times the step to 2 (the deployment's 6 at most), for 30000 prompt tokens/s")
    # Deployed at 4, the second step stops at the deployment; at 1, each step is what the load needs.
    assert prefill_targets(run(planner(**stepped), rise, (4, 1)))[24:] == [1, 1, 3, 4]
    assert prefill_targets(run(planner(**stepped, rise_step_below_deployment=1), rise, (6, 1)))[24:] == [1, 1, 2, 4]


def test_below_the_deployment_a_rise_over_the_last_start_up_is_met_ahead():
    # Deployed at 6, the pool at 1 after the warm-up. At the first 10 req/s the last start-up's
    # average (5 and 10 req/s: 0.75 replicas of prompt load) is 1.5 times the one before (0.5), and
    # grown on at that rate a start-up and half an interval ahead (1.75 start-ups) it is 1.53
    # replicas, which 2 carry: the pool grows (twice the step, to 3) an interval before the window
    # alone would grow it. At 20 req/s the start-up (1.5) is 3 times the one before: the deployment's
    # 6, where the window alone reaches 3. No room for rises, to see this rule alone.
    rise = [5] * 26 + [10, 20, 30, 30]
    fields = {"base_window_s": 600, "scale_down_cooldown_s": 0, "rise_room_below_deployment": False}
    decisions = run(planner(**fields), rise, (6, 1))
    assert prefill_targets(decisions)[25:] == [1, 3, 6, 6, 6]
    assert decisions[26].reasons["prefill"].endswith(
        "; rising over the last start-up, 2 for the load a start-up and half an interval ahead (the deployment's 6 at most)"
    )
    assert prefill_targets(run(planner(**fields, rise_ahead_below_deployment=False), rise, (6, 1)))[25:] == [1, 1, 3, 3, 5]
    # At most the deployment: deployed at 4, the pool stops there.
    assert max(prefill_targets(run(planner(**fields), rise, (4, 1)))[25:]) == 4
    # While the load still rises over the last start-up, the pool does not shrink below its
    # projection: the window alone would take the 5 back to 2 at the second 12 req/s, which is
    # still 1.85 times the start-up before (4); then the rise is over. (At the growth of the last
    # two intervals, 5, 8, 12, the first 12 req/s projects the deployment's 6: see the next test.)
    at_start_ups = planner(**fields, rise_ahead_at_latest_growth=False)
    assert prefill_targets(run(at_start_ups, [5] * 26 + [8, 12, 12, 12], (6, 1)))[26:] == [3, 5, 4, 2]


def test_below_the_deployment_a_surge_that_accelerates_is_met_at_its_latest_growth():
    # Deployed at 8, the pool at 2 once 6 and 7 req/s have passed. At 11 req/s the start-up's
    # average (8 and 11: 9.5) is 1.46 times the one before (6.5): 18.5 req/s 1.75 start-ups ahead,
    # which the 2 it has carry. The last three intervals rose each (7, 8, 11), 1.57 times over two
    # intervals: 11 x 1.57 ** 1.5 = 21.7 req/s at the same point, three intervals ahead of the
    # newest one's middle, which needs 3. The pool grows an interval before the start-up's growth
    # alone would grow it. One step at a time, and no room for rises, to see this rule alone.
    surge = [5] * 26 + [6, 7, 8, 11, 16, 24]
    fields = {"base_window_s": 600, "scale_down_cooldown_s": 0, "rise_room_below_deployment": False, "rise_step_below_deployment": 1}
    decisions = run(planner(**fields), surge, (8, 1))
    assert prefill_targets(decisions)[27:] == [2, 2, 3, 5, 8]
    assert decisions[29].reasons["prefill"].endswith(
        "; rising over the last start-up, 3 for the load a start-up and half an interval ahead at the growth of the last two"
        " intervals, which rose each (the deployment's 8 at most)"
    )
    assert prefill_targets(run(planner(**fields, rise_ahead_at_latest_growth=False), surge, (8, 1)))[27:] == [2, 2, 2, 4, 8]
    # A load whose last three intervals did not each rise is projected at its start-up's growth alone.
    wobble = [5] * 26 + [6, 7, 9, 8, 11, 11]
    assert prefill_targets(run(planner(**fields), wobble, (8, 1))) == prefill_targets(
        run(planner(**fields, rise_ahead_at_latest_growth=False), wobble, (8, 1))
    )


def spikes(p: SLAPlanner, n: int, deployed: int, every: int = 25) -> list:
    """5 req/s whose answers are 50 tokens (one decode replica) but 600 (four) in every ``every``-th
    interval: a spike holds 4% of the requests, under the 5% the window's quantile leaves out, while
    the two intervals before each (those a start-up of 30 s and an interval ahead of it) rose by 3."""
    return decide_each(p, [observe(INTERVAL_S * (i + 1), 5, output_tokens=600 if i % every == every - 1 else 50) for i in range(n)], (1, deployed))


def decode_targets(decisions) -> list[int]:
    return [d.targets["decode"] for d in decisions]


def test_below_the_deployment_a_pool_keeps_room_for_the_rises_its_load_has_shown():
    # A reaction of two intervals, no trend, no rise met ahead of the window.
    quick = {"startup_s": 30.0, "rise_start_ups": 0, "scale_down_cooldown_s": 0, "rise_ahead_below_deployment": False}
    decisions = spikes(planner(**quick), 100, deployed=6)
    # The warm-up (1200 s) holds the deployment; then the pool keeps 1 for the quiet load and 3 for
    # the rise, and a spike finds 4 warm.
    assert decode_targets(decisions)[:39] == [6] * 39
    assert decode_targets(decisions)[39:49] == [4] * 10 and decisions[48].rise_room == {"decode": 3}
    assert decisions[48].reasons["decode"].endswith(
        "; 4 for the 1 the load needs now and a rise of 3 the window saw within a start-up and an interval (the deployment's 6 at most)"
    )
    assert decisions[48].rise_room.get("prefill") is None  # its load never rose
    # The window alone leaves the spikes out: the pool stays at 1 and each spike misses its ITL.
    alone = spikes(planner(**quick, rise_room_below_deployment=False), 100, deployed=6)
    assert decode_targets(alone)[39:] == [1] * 61 and all(not d.rise_room for d in alone)
    # At most the deployment: deployed at 3, the pool stays there.
    assert decode_targets(spikes(planner(**quick), 100, deployed=3)) == [3] * 100


def test_below_the_deployment_a_pool_grows_for_the_load_now_before_the_window_lets_it_in():
    # Four decode replicas of load from 1,380 s, after 45 quiet intervals: the window's quantile
    # leaves its first interval out, and without room the pool waits two intervals at 1.
    quick = {"startup_s": 30.0, "rise_start_ups": 0, "scale_down_cooldown_s": 0, "rise_ahead_below_deployment": False}
    answers = [50] * 45 + [600] * 20
    observations = [observe(INTERVAL_S * (i + 1), 5, output_tokens=n) for i, n in enumerate(answers)]
    decisions = decide_each(planner(**quick), observations, (1, 6))
    assert decode_targets(decisions)[39:47] == [1] * 6 + [6, 6] and decisions[45].rise_room == {"decode": 0}
    assert decisions[45].reasons["decode"].endswith("; 4 for the load now, over what the window's 0.95 quantile needs (the deployment's 6 at most)")
    assert decode_targets(decide_each(planner(**quick, rise_room_below_deployment=False), observations, (1, 6)))[39:48] == [1] * 8 + [6]


def test_a_level_let_go_takes_its_rise_with_it():
    # A level of 4 decode replicas for 8 intervals (past the 6 a burst lasts with a 600 s window)
    # rose by 3 within a reaction: while it holds, its rise is room like any other, but once it is
    # let go the load is back to a quiet one that has never risen, and so is the pool.
    p = planner(startup_s=30.0, rise_start_ups=0, base_window_s=600, scale_down_cooldown_s=0)
    answers = [50] * 30 + [600] * 8 + [50] * 12
    decisions = decide_each(p, [observe(INTERVAL_S * (i + 1), 5, output_tokens=n) for i, n in enumerate(answers)], (1, 6))
    assert decode_targets(decisions)[19:30] == [1] * 11 and decisions[31].rise_room == {"decode": 3}
    released = decisions[39]
    assert "decode" in released.released_levels and not released.rise_room
    assert decode_targets(decisions)[39:] == [1] * 11


def test_a_load_above_max_over_the_window_holds_at_max_and_is_flagged():
    p = planner(max_prefill=2, min_decode=2)
    for decision in run(p, [30] * 5, (1, 1)):  # 3 replicas of prompt load need 4
        assert dict(decision.targets) == {"prefill": 2, "decode": 2}
        assert decision.infeasible == ("prefill",) and decision.infeasible_requests == 0
        assert decision.reasons["prefill"].startswith("no count up to 2 meets the SLO")


def test_a_mean_prompt_slower_than_the_slo_holds_at_max_every_interval_and_says_so():
    p = planner(ttft_slo_s=0.05, max_prefill=3)  # a 1000-token prompt alone takes 0.1 s; no histogram says which
    for decision in run(p, [1] * 4, (1, 1)):
        assert decision.targets["prefill"] == 3 and decision.infeasible == ("prefill",)


def test_a_backlog_of_queued_prompt_tokens_grows_prefill():
    p = planner()
    assert p.decide(observe(30, 5), pools(1, 1)).targets["prefill"] == 1
    # 1,800,000 tokens queued are 180 replica-seconds: 2 replicas clear them within a start-up and an
    # interval (90 s); with the 0.5 of load, 2.5 replicas need 3.
    decision = p.decide(observe(60, 5, queued_prefill_tokens=1_800_000), pools(1, 1))
    assert decision.targets["prefill"] == 3 and decision.reasons["prefill"].endswith("1800000 tokens queued")


def test_a_backlog_a_new_prompt_would_wait_less_than_the_slo_for_changes_nothing():
    """10,000 queued tokens are 1 s of one replica's work, under the 1.9 s a 1000-token prompt may
    wait (a 2 s SLO less its 0.1 s prefill): the pool stays. 30,000 (3 s) are over it, but one
    replica at 0.5 of load clears them well within a start-up: it stays. 600,000 (60 s of work, 0.67
    of a replica over 90 s) with the 0.5 of load need 2."""
    p = planner()
    assert p.decide(observe(30, 5), pools(1, 1)).targets["prefill"] == 1
    assert p.decide(observe(60, 5, queued_prefill_tokens=10_000), pools(1, 1)).targets["prefill"] == 1
    assert p.decide(observe(90, 5, queued_prefill_tokens=30_000), pools(1, 1)).targets["prefill"] == 1
    decision = p.decide(observe(120, 5, queued_prefill_tokens=600_000), pools(1, 1))
    assert decision.targets["prefill"] == 2 and decision.reasons["prefill"].endswith("600000 tokens queued")


def test_prompts_of_the_same_mean_with_a_heavier_tail_need_at_least_as_many_prefill_replicas():
    def prefill_at_high_load(buckets) -> tuple[int, float]:
        p = planner(**ALONE)
        for t in (30, 60, 90, 120):
            decision = p.decide(Observation(t, INTERVAL_S, 1800, 1800 * 1000, 1800 * 10, prompt_length_counts=buckets), pools(1, 1))
        return decision.needed["prefill"], p.sizer.spread

    uniform = prefill_at_high_load(((512.0, 0), (2048.0, 1800), (math.inf, 0)))
    tailed = prefill_at_high_load(((128.0, 0), (512.0, 1620), (16384.0, 180), (math.inf, 0)))
    assert uniform[1] < 1 < tailed[1]
    assert tailed[0] >= uniform[0] and tailed[0] > 6  # 60 req/s of 1000 tokens: 6 replicas of load


def test_prefill_goes_to_zero_when_prompts_are_few_and_comes_back_when_the_decode_replicas_cannot_carry_them():
    p = planner(scale_down_cooldown_s=0, base_window_s=60)
    decisions = run(p, [0.5] * 4, (1, 1), prompt_tokens=100)  # 50 prompt tokens/s: 0.005 replicas
    assert prefill_targets(decisions) == [1, 0, 0, 0]
    # 5 req/s: 0.5 replicas of load, averaged with the 0.005 before it, is over prefill_zero_load, but
    # the decode replica prefilling that quarter of its time still meets the ITL SLO for 250 tokens/s:
    # a prefill pool beside it would be a replica more, so the cluster stays aggregated.
    decision = p.decide(observe(150, 5), pools(0, 1))
    assert dict(decision.targets) == {"prefill": 0, "decode": 1}
    assert decision.reasons["prefill"].endswith("the decode replicas prefill it themselves, 1 of them instead of two pools")
    # 30 req/s: (0.5 + 3) / 2 = 1.75 replicas of prompt load; no decode replica prefills that and
    # decodes too, so the prefill pool comes back at 2.
    decision = p.decide(observe(180, 30), pools(0, 1))
    assert decision.targets["prefill"] == 2 and decision.reasons["prefill"].startswith("up to 2")


def test_an_aggregated_cluster_counts_the_sequences_running_in_its_batches():
    # 3 req/s of 1000 tokens: one decode replica prefilling them stalls 0.3 of its time and keeps
    # its ITL under 0.07 s, a batch of 51 less its swing, 39.6: 147 output tokens/s fit, but 60
    # running sequences do not, so the cluster needs a replica more (and brings the prefill pool back).
    fields = {"scale_down_cooldown_s": 0, "base_window_s": 30}
    decision = planner(**fields).decide(observe(30, 3, decode_running=60), pools(0, 1))
    assert dict(decision.targets) == {"prefill": 1, "decode": 1}
    assert decision.reasons["decode"] == "holding at 1 for 60 sequences running at a batch of 67 per replica (147 output tokens/s)"
    decision = planner(aggregated_counts_running=False, **fields).decide(observe(30, 3, decode_running=60), pools(0, 1))
    assert dict(decision.targets) == {"prefill": 0, "decode": 1}
    # 30 running fit the one replica's batch of 39.6: it stays aggregated.
    assert dict(planner(**fields).decide(observe(30, 3, decode_running=30), pools(0, 1)).targets) == {"prefill": 0, "decode": 1}


def test_an_aggregated_cluster_grows_its_decode_replicas_for_a_rise_of_its_decode_load():
    # Deployed at 0 + 3, shrunk to 0 + 1 on 150 output tokens/s; then the answers grow (240, 390,
    # 600 tokens/s): at 390 the decode pool alone would meet the rise ahead at the deployment's 3.
    def targets(keeps_rises: bool) -> tuple[list, str]:
        config = PlannerConfig(interval_s=INTERVAL_S, startup_s=60.0, scale_down_cooldown_s=0, base_window_s=300, aggregated_keeps_rises=keeps_rises, hold_deployment_until_needed_s=0.0)
        p, now, seen = SLAPlanner(config, PERF), (0, 3), []
        for i, output_tokens in enumerate([50] * 15 + [80, 130, 200]):
            decision = p.decide(observe(30 + 30 * i, 3, output_tokens=output_tokens), pools(*now))
            now = (decision.targets["prefill"], decision.targets["decode"])
            seen.append(now)
        return seen[-4:], decision.reasons["decode"]

    seen, why = targets(True)
    assert seen == [(0, 1), (0, 1), (0, 3), (0, 3)]  # aggregated still: the 3 decode replicas prefill too
    assert "every prompt, prefilled on the decode replicas, 1 more for what the decode load alone asks beyond its window" in why
    assert "rising over the last start-up, 3 for the load a start-up and half an interval ahead" in why
    # Without it the window's count alone sizes the aggregated pool: it lags the rise an interval,
    # and then the prefill pool comes back beside it.
    seen, _ = targets(False)
    assert seen == [(0, 1), (0, 1), (0, 1), (1, 3)]


def test_answers_that_lengthen_grow_the_decode_pool_ahead_of_their_running_count():
    # Deployed at 0 + 3 and shrunk to 0 + 1 on 2 req/s whose 6 running sequences each run 3 s
    # (Little's law: 6 / 2). Then 24 run at the same rate: 12 s each, past the 6 the rate keeps at
    # the window's longest 3 s (and its swing, 1.645 * sqrt(6)). The count grown on at its last
    # growth, 18 an interval, to a start-up and half an interval ahead is 24 + 18 * 2.5 = 69: two
    # batches of 67.5, and the pool grows (twice the step, at most the deployment) now.
    def last(running: list[int], rates: list[float], flag: bool = True) -> tuple[tuple[int, int], str]:
        config = PlannerConfig(interval_s=INTERVAL_S, startup_s=60.0, scale_down_cooldown_s=0, base_window_s=300, lengthening_ahead_below_deployment=flag, hold_deployment_until_needed_s=0.0)
        p, now = SLAPlanner(config, PERF), (0, 3)
        for i, (count, rate) in enumerate(zip([6] * 14 + running, [2.0] * 14 + rates)):
            decision = p.decide(observe(30 + 30 * i, rate, decode_running=count), pools(*now))
            now = (decision.targets["prefill"], decision.targets["decode"])
        return now, decision.reasons["decode"]

    now, why = last([24], [2.0])
    assert now == (0, 3)
    assert (
        "answers lengthening (24 sequences running, 18 more, 12.0 s each at the request rate, longer than the window's 3.0),"
        " 2 for 69 running a start-up and half an interval ahead (the deployment's 3 at most)" in why
    )
    # Off, the 24 fit the one replica's batch and the decoded tokens have not moved yet: it holds.
    assert last([24], [2.0], flag=False)[0] == (0, 1)
    # Within the count's swing (9 of at most 10), or risen with the rate (12 at 4 req/s: 3 s each), it is not lengthening.
    assert "answers lengthening" not in last([9], [2.0])[1]
    assert "answers lengthening" not in last([12], [4.0])[1]


def test_hold_deployment_until_needed_keeps_the_deployment_until_the_load_has_needed_it():
    # Deployed at 2 + 2 over 3 req/s (1 + 1 carry it), a 300 s window: the warm-up's end shrinks both pools.
    def targets(hold_s: float | None, rates: list[float]) -> tuple[list, dict]:
        held = {} if hold_s is None else {"hold_deployment_until_needed_s": hold_s}
        config = PlannerConfig(interval_s=INTERVAL_S, startup_s=60.0, base_window_s=300, scale_down_cooldown_s=0, **held)
        p, now, seen = SLAPlanner(config, PERF), (2, 2), []
        for i, rate in enumerate(rates):
            decision = p.decide(observe(30 + 30 * i, rate), pools(*now))
            now = (decision.targets["prefill"], decision.targets["decode"])
            seen.append(now)
        return seen, decision.reasons

    seen, _ = targets(0.0, [3] * 16)
    assert seen[8:10] == [(2, 2), (1, 1)]
    # On (by default, with no limit), the deployment stays while no interval's load has needed it, and says why.
    seen, why = targets(None, [3] * 16)
    assert set(seen) == {(2, 2)}
    assert why["prefill"] == "holding at 2: no interval's load has needed the deployment's 2 yet (480 s observed)"
    seen, why = targets(3600.0, [3] * 16)
    assert set(seen) == {(2, 2)} and why["prefill"].endswith("(480 of 3600 s observed)")
    # Once 18 req/s have needed 2 + 2 (1.8 prefill replicas of prompts, 900 output tokens/s), the window decides again.
    seen, _ = targets(None, [3] * 4 + [18] * 3 + [3] * 16)
    assert seen[-1] == (1, 1) and (2, 2) in seen[7:15]
    # And after the seconds it is given, unneeded, the deployment goes.
    seen, _ = targets(600.0, [3] * 24)
    assert seen[17:20] == [(2, 2), (2, 2), (1, 1)]


def test_a_long_level_is_kept_below_the_deployment_twice_as_long_after_it_as_it_held():
    # Deployed at 2 + 2; 3 req/s needs 1 + 1 and 18 req/s needs 2 + 2. A 300 s window remembers a
    # level for 300 s after it ends; a level of ten intervals (about 4.5 minutes counted, its
    # start-up averages included) is kept for twice that and a reaction (a start-up and an interval).
    def after_level(level: int, lengths: float, start: tuple[int, int] = (2, 2), blip: int | None = None, max_s: float | None = None) -> tuple[int, list]:
        p = planner(base_window_s=300.0, scale_down_cooldown_s=0, level_memory_lengths=lengths, level_memory_max_s=max_s)
        rates = [3] * 12 + [18] * level + [3] * 80
        if blip is not None:  # two intervals at 18 req/s, ``blip`` intervals after the level
            rates[12 + level + blip] = rates[13 + level + blip] = 18
        decisions = run(p, rates, start)
        after = decisions[12 + level:]
        return next(i for i, d in enumerate(after) if min(d.targets.values()) < 2), after

    assert after_level(10, 0.0)[0] == 9  # the window alone
    shrunk, after = after_level(10, 2.0)
    assert shrunk == 20
    kept = after[shrunk - 1]
    assert dict(kept.long_levels) == {"prefill": 2, "decode": 2} and dict(kept.targets) == {"prefill": 2, "decode": 2}
    assert "2 kept for the level of 4 minutes that needed it until 10 minutes ago (kept 2 times as long after it as it held, 20 minutes at most)" in kept.reasons["prefill"]
    assert after[shrunk].targets["decode"] == 1 and "decode" not in after[shrunk].long_levels
    # Prefill's run counts longer (at its scale-down margin, its averaged count stays at 2 an interval
    # or two more), and it goes once its own level is over.
    prefill_shrunk = next(i for i, d in enumerate(after) if d.targets["prefill"] < 2)
    assert shrunk < prefill_shrunk <= shrunk + 6 and not after[prefill_shrunk].long_levels
    # A blip in the quiet after it is a short run of its own (kept no longer than the window, which
    # lets it go 10 intervals later): it does not end the level's memory.
    assert after_level(10, 2.0, blip=5)[0] == 20
    # A level kept for less than the window (two intervals: 2 x 60 s + 90 s) is left to the window.
    assert after_level(2, 2.0)[0] == after_level(2, 0.0)[0] == 9
    # Above the deployment nothing is kept: deployed at 1 + 1, the pools go back once the window lets the level go.
    assert [d.targets["prefill"] for d in after_level(10, 2.0, (1, 1))[1][:8]] == [d.targets["prefill"] for d in after_level(10, 0.0, (1, 1))[1][:8]]
    with pytest.raises(ValueError, match="level_memory_lengths must be 0"):
        PlannerConfig(level_memory_lengths=-1.0)


def test_a_level_is_kept_no_longer_than_four_windows_after_it():
    # As above (a 300 s window, 2 + 2 for 18 req/s, 1 + 1 for 3), a level of 30 intervals: kept
    # twice its length and a reaction it would hold the pools about 60 intervals after it; four windows
    # (1200 s, 40 intervals) is the most a level is kept by default, so that a level of hours (a
    # day's peak) does not pin the pools at it through the trough.
    def shrunk_after(max_s: float | None, lengths: float = 2.0) -> tuple[int, list]:
        p = planner(base_window_s=300.0, scale_down_cooldown_s=0, level_memory_lengths=lengths, level_memory_max_s=max_s)
        after = run(p, [3] * 12 + [18] * 30 + [3] * 80, (2, 2))[42:]
        return next(i for i, d in enumerate(after) if min(d.targets.values()) < 2), after

    uncapped, capped = shrunk_after(1e9)[0], shrunk_after(None)
    assert uncapped >= 60 and 38 <= capped[0] <= 41
    assert "(kept 2 times as long after it as it held, 20 minutes at most)" in capped[1][capped[0] - 1].reasons["decode"]
    assert shrunk_after(600.0)[0] in (19, 20, 21)  # ten minutes, as given
    assert shrunk_after(0.0)[0] == shrunk_after(None, lengths=0.0)[0] < 9  # none: as off (a level this long is let go as a shift)
    with pytest.raises(ValueError, match="level_memory_max_s must be 0 or more"):
        PlannerConfig(level_memory_max_s=-1.0)


def test_aggregate_when_cheaper_lets_one_decode_replica_prefill_what_two_pools_would_split():
    # 3 req/s of 1000 tokens: 0.3 prefill replicas of prompt load (over prefill_zero_load) and
    # 150 output tokens/s. One decode replica prefilling them stalls 0.3 of its time (0.375 with
    # the 0.8 margin): it keeps ITL under 0.0625 s, batch 43, 33.5 after the Poisson swing, and
    # makes 0.625 * 33.5 / 0.0525 = 399 tokens/s, more than 150 / 0.8. Two pools would be 1 + 1.
    fields = {"scale_down_cooldown_s": 0, "base_window_s": 60}
    assert dict(run(planner(**fields), [3] * 6, (1, 1))[-1].targets) == {"prefill": 1, "decode": 1}
    p = planner(aggregate_when_cheaper=True, **fields)
    decision = run(p, [3] * 6, (1, 1))[-1]
    assert dict(decision.targets) == {"prefill": 0, "decode": 1}
    assert "the decode replicas prefill it themselves, 1 of them" in decision.reasons["prefill"]
    # 5 req/s: 0.5 of the time prefilling leaves a batch of 23 at 0.05 s, 274 tokens/s for 250 asked,
    # but not with the margin's headroom; the cluster is aggregated already, so it stays so.
    assert dict(run(planner(aggregate_when_cheaper=True, **fields), [5] * 6, (0, 1))[-1].targets) == {"prefill": 0, "decode": 1}
    # The same load met with two pools does not swap to one: entering needs the margin's headroom.
    assert dict(run(planner(aggregate_when_cheaper=True, **fields), [5] * 6, (1, 1))[-1].targets) == {"prefill": 1, "decode": 1}
    # Prompts return (30 req/s): the prefill pool comes back at once, at (0.3 + 3) / 2 -> 2, then 4.
    assert prefill_targets(run(p, [30, 30], (0, 1), start_s=210, output_tokens=10)) == [2, 4]


def test_aggregate_when_cheaper_keeps_the_prefill_pool_until_the_decode_replicas_taking_its_load_are_ready():
    fields = {"scale_down_cooldown_s": 0, "aggregate_when_cheaper": True, "min_decode": 2, "base_window_s": 60}
    assert dict(run(planner(**fields), [3] * 6, (1, 2))[-1].targets) == {"prefill": 0, "decode": 2}
    p = planner(**fields)
    for t in range(30, 210, 30):
        decision = p.decide(observe(t, 3), pools(1, 1, decode_starting=1))
    assert dict(decision.targets) == {"prefill": 1, "decode": 2}
    assert "kept until" in decision.reasons["prefill"]


def test_corrections_use_ready_replicas_and_skip_intervals_when_the_ready_count_changed():
    p = planner()
    p.decide(observe(30, 5), pools(1, 1))
    # rho 0.5 on one ready replica: the model's mean TTFT is 0.1 / (1 - 0.5) = 0.2 s; 0.3 s observed
    decision = p.decide(observe(60, 5, ttft_s_mean=0.3), pools(1, 1, prefill_starting=1))
    assert decision.corrections["prefill"] == pytest.approx(1.25)  # smoothed halfway from 1 to 1.5
    decision = p.decide(observe(90, 5, ttft_s_mean=0.3), pools(2, 1))  # the second replica became ready
    assert decision.corrections["prefill"] == pytest.approx(1.25)


def test_the_decode_correction_sizes_the_batch_on_decoded_tokens_not_first_tokens():
    """5 req/s of 21-token answers stream 105 tokens/s, of which the decode pool made 100. At an
    observed ITL m with itl(100 m) = m (m = 0.019 / 0.9), the model is exact: the correction stays 1
    (on the 105 streamed it would read the batch 5% large and drift to 0.9975)."""
    p = planner()
    p.decide(observe(30, 5, output_tokens=21), pools(1, 1))
    decision = p.decide(observe(60, 5, output_tokens=21, itl_s_mean=0.019 / 0.9), pools(1, 1))
    assert decision.corrections["decode"] == pytest.approx(1.0, abs=1e-9)


def test_the_forecast_is_reported_but_does_not_size_the_pools():
    p = planner(scale_down_cooldown_s=0, base_window_s=60)
    rising = run(p, [5, 10, 20, 40], (1, 1), output_tokens=10)
    # The trend forecasts more than 40 req/s; the pool is sized for 4 replicas of load averaged with 2.
    assert rising[-1].forecast.prompt_tokens_per_s > 40_000
    assert rising[-1].needed["prefill"] == p.sizer.prefill_count(3.0, 0.85)


def test_the_same_inputs_give_the_same_decisions():
    runs = []
    for _ in range(2):
        p = planner()
        runs.append([p.decide(observe(30 * i, r, ttft_s_mean=0.2, itl_s_mean=0.03), pools(2, 2)) for i, r in enumerate([5, 20, 12, 3], 1)])
    assert runs[0] == runs[1]


def test_the_warm_up_is_a_start_up_and_an_interval_over_the_miss_share_even_under_a_longer_window():
    """With a 6 s start-up, 30 s intervals and a 0.95 target the warm-up is (6 + 30) / 0.05 = 720 s; a
    1200 s window remembers longer but does not hold a pool of 4 that 0.5 replicas of load fill
    for all 1200 s: it shrinks once 720 s have been observed."""
    p = planner(startup_s=6.0, base_window_s=1200.0)
    targets = prefill_targets(run(p, [5] * 26, (4, 1)))
    assert targets[:23] == [4] * 23 and targets[23:] == [1] * 3  # decided at 30 ... 690 s; 720 s on shrinks


RAMP = list(range(4, 44, 4))
"""Ten intervals from 4 to 40 req/s of 1000-token prompts: start-up means (two intervals each) of
0.6, 1.4, 2.2, 3.0 and 3.8 prefill replicas of load, each above the one before."""


def test_a_load_rising_over_each_of_four_start_ups_grows_the_pool_to_its_projection_at_once():
    p = planner()
    assert p.window.window_s == 1800 and p.trend.num_start_ups == 4
    decisions = run(p, RAMP, (1, 1), output_tokens=10)
    # The load already needs more than the deployment's 1: the projection is no bet, it needs no savings.
    assert decisions[-1].saved_replica_s == 0 and decisions[-1].unfunded_trends == ()
    # Until ten intervals are seen the window alone sizes the pool: 3.4 replicas averaged at 270 s -> 4.
    assert prefill_targets(decisions)[:9] == [1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert all("rising" not in d.reasons["prefill"] for d in decisions[:9])
    # At 300 s: 3.8 + 0.8 a start-up x (75 s + 30 s from the newest start-up's middle) / 60 s = 5.2
    # replicas of load a start-up and half an interval ahead; the window's 3.8 alone would need 4.
    last = decisions[-1]
    assert p.sizer.prefill_count(3.8, 0.85) == 4 and last.targets["prefill"] == p.sizer.prefill_count(5.2, 0.85) == 6
    assert last.reasons["prefill"].endswith("rising over each of the last 4 start-ups, 6 for the load a start-up and half an interval ahead")


def test_a_decode_trend_is_projected_at_each_replicas_own_swing():
    """Decoded tokens rise 800 a second each interval, to 8,000: start-up means of 1,200 to 7,600,
    1.54 to 9.74 replicas at the 780 tokens/s of a replica keeping room for its own swing, projected
    to 9.74 + 8.2 / 4 x 1.75 = 13.3 -> 14. A pool growing into a rise is not one balanced batch (its
    sequences stay where they joined), so the pooled swing (13.0 -> 13) does not size the bet."""
    p = planner()
    run(p, [5] * 10, (1, 1), output_tokens=1, prompt_tokens=10)
    decisions = [p.decide(observe(330 + 30 * i, 5, output_tokens=1 + 160 * (i + 1), prompt_tokens=10), pools(1, 1)) for i in range(10)]
    own = [(1200 + 1600 * i) / p.sizer.decode_rate(0.1)[1] for i in range(5)]
    assert decisions[-1].targets["decode"] == math.ceil(own[-1] + (own[-1] - own[0]) / 4 * 1.75) == 14
    assert decisions[-1].reasons["decode"].endswith("rising over each of the last 4 start-ups, 14 for the load a start-up and half an interval ahead")


def test_a_trend_the_deployment_still_carries_is_bet_on_only_with_the_replicas_saved_below_it():
    """The same ramp over a deployment of 4: its load (3.8 replicas at 300 s) needs no more than the 4
    the planner started over, so the projection's 6 is a bet. The pools have spent nothing below the
    deployment (the warm-up held it), and two replicas for a start-up and an interval cost 180
    replica-seconds: not bet on. The same planner with bets unfunded allowed grows to 6."""
    decisions = run(planner(), RAMP, (4, 1), output_tokens=10)
    last = decisions[-1]
    assert prefill_targets(decisions) == [4] * 10 and last.unfunded_trends == ("prefill",) and last.saved_replica_s == 0
    assert last.reasons["prefill"].endswith(
        "rising over each of the last 4 start-ups, 6 for the load a start-up and half an interval ahead, not bet on: 0 replica-seconds saved below the deployment's 4, 180 needed"
    )
    assert prefill_targets(run(planner(trend_bets_from_savings=False), RAMP, (4, 1), output_tokens=10))[-1] == 6


def test_replicas_saved_below_the_deployment_pay_for_a_bet_and_the_bet_held_is_paid_from_them():
    """A 300 s window (k = 3) over a deployment of 4 at 4 req/s: the pool goes to 1 when the warm-up
    ends (300 s), and saves 3 replicas x 30 s an interval. The ramp that follows is bet on at 600 s
    (2 to 4 on 810 saved replica-seconds), and each interval the bet holds 2 replicas above the 2
    the pool had before the rise, 60 replica-seconds come off."""
    # Each rise met at its own step (not twice it, nor ahead, nor with room for the ramp's own rises,
    # below the deployment), so that only the bet spends.
    decisions = run(
        planner(base_window_s=300, scale_down_cooldown_s=0, rise_step_below_deployment=1, rise_room_below_deployment=False, rise_ahead_below_deployment=False),
        [4] * 14 + RAMP, (4, 1), output_tokens=10,
    )
    by_time = {d.time_s: d for d in decisions}
    assert [by_time[t].targets["prefill"] for t in (270, 300, 570, 600)] == [4, 1, 2, 4]
    assert by_time[600].saved_replica_s == 810 and by_time[600].unfunded_trends == ()
    assert "rising over each of the last 3 start-ups, 4 for the load" in by_time[600].reasons["prefill"]
    assert by_time[630].saved_replica_s == 810 - 2 * 30


def test_a_pool_grown_on_a_rise_goes_back_once_the_load_falls_without_waiting_for_the_cooldown():
    p = planner(scale_down_cooldown_s=300, **REMEMBER)
    decisions = run(p, RAMP + [36, 36], (1, 1), output_tokens=10)
    # At 330 s the newest start-up (40, 36 req/s) is still above the one before (32, 36): held at 6.
    assert prefill_targets(decisions)[-3:] == [6, 6, 4]
    # At 360 s (36, 36) is below (36, 40): back to 4, what the pool had before the rise and the
    # window's quantile needs, 60 s after the change (the cooldown is 300 s).
    assert decisions[-1].reasons["prefill"].startswith("back to 4: the rise is over")


def test_a_pool_does_not_shrink_below_a_trends_projection_while_the_load_rises():
    # A 300 s window (k = 3) over a deployment of 6, the pool at 1 after the warm-up, then RAMP.
    # Twice the step takes the pool to 6 at 540 s; the window alone would take it back to 4 at
    # 570 s while the trend projects 5, and to 6 again after: the projection holds it at 5.
    off = {"rise_room_below_deployment": False, "rise_ahead_below_deployment": False}
    decisions = run(planner(base_window_s=300, scale_down_cooldown_s=0, **off), [4] * 12 + RAMP, (6, 1), output_tokens=10)
    assert prefill_targets(decisions)[17:] == [6, 5, 5, 5, 6]
    assert "rising over each of the last 3 start-ups, 5 for the load" in decisions[18].reasons["prefill"]


def test_a_step_up_is_left_to_the_window_and_not_projected():
    p = planner()
    # 5 then 30 req/s: the start-up means rise twice (the step's first interval, then its second), then stay.
    decisions = run(p, [5] * 6 + [30] * 10, (1, 1), output_tokens=10)
    assert prefill_targets(decisions)[6:] == [2] + [4] * 9
    assert all("rising" not in d.reasons["prefill"] for d in decisions)


def test_rise_start_ups_is_derived_from_the_window_and_the_miss_share_or_set():
    assert planner().trend.num_start_ups == 4  # 5! = 120 >= 60 intervals
    assert planner(base_window_s=300).trend.num_start_ups == 3  # 4! = 24 >= max(10 intervals, 1 / 0.05)
    assert planner(attainment_target=0.99, base_window_s=300).trend.num_start_ups == 4  # 5! >= 100
    off = planner(rise_start_ups=0)
    assert prefill_targets(run(off, RAMP, (1, 1), output_tokens=10))[-1] == 4  # the window alone
    with pytest.raises(ValueError, match="rise_start_ups must be 0 or more"):
        PlannerConfig(rise_start_ups=-1)


def test_sequences_running_count_as_decode_load_before_their_tokens_have_streamed():
    """Long answers that have just joined the batch stream few tokens in their first interval; the
    sequences running say how many decode replicas they need: a replica's batch is 81 at the 0.1 s
    SLO, 74.6 in a pool of 5 (less 1.645 * sqrt(74.6 / 5) for its share of the swing); 300 running
    are 4.02 replicas, averaged with the interval before over the start-up, 3."""
    streamed_only, with_running = planner(), planner()
    for p in (streamed_only, with_running):
        run(p, [5] * 6, (1, 1))
    assert streamed_only.decide(observe(210, 5), pools(1, 1)).targets["decode"] == 1
    decision = with_running.decide(observe(210, 5, decode_running=300), pools(1, 1))
    assert decision.targets["decode"] == 3
    assert decision.reasons["decode"].startswith("up to 3 for 300 sequences running at a batch of 75 per replica")


def test_decode_does_not_shrink_below_the_replicas_that_hold_its_kv_in_use():
    # 5 req/s of 50-token answers and the 60 sequences running need one decode replica, but these
    # fill 0.6 of the KV of the 3 there are: grown by its swing (1.645 / sqrt(60), 21%), 2 would
    # fill past 0.9.
    def decide(kv_usage, **fields):
        p = planner(**ALONE, scale_down_cooldown_s=0, **fields)
        return p.decide(observe(30.0, 5, kv_usage=kv_usage, decode_running=60), pools(1, 3))

    held = decide(0.6)
    assert held.targets["decode"] == 3
    assert "not below 3: the KV in use (0.60 of 3 replicas', 21% more at its swing) would fill fewer past 0.9" in held.reasons["decode"]
    assert decide(0.4).targets["decode"] == 2  # 0.4 * 1.21 * 3 / 0.9 = 1.6 replicas of KV
    assert decide(0.6, kv_holds_decode=False).targets["decode"] == 1
    assert decide(None).targets["decode"] == 1


def _turns_per_hour(decisions, pool: str) -> int:
    """The most changes of direction ``pool``'s targets made within any hour of ``decisions``."""
    steps = [(b.time_s, b.targets[pool] > a.targets[pool]) for a, b in zip(decisions, decisions[1:]) if b.targets[pool] != a.targets[pool]]
    turns = [t for (_, x), (t, y) in zip(steps, steps[1:]) if x != y]
    return max((sum(t <= u < t + 3600 for u in turns) for t in turns), default=0)


def test_a_pool_at_a_counts_edge_changes_direction_at_most_the_flap_limit_times_an_hour():
    # Each interval alone decides (ALONE, no cooldown): 18 req/s needs 2 + 2, 3 needs 1 + 1, so a
    # load that alternates flaps the pools every interval unless the limit holds them.
    rates = [18, 3] * 120  # two hours
    free = run(planner(**ALONE, scale_down_cooldown_s=0, flap_limit_per_hour=0), rates, (2, 2))
    assert _turns_per_hour(free, "prefill") > 100
    limited = run(planner(**ALONE, scale_down_cooldown_s=0), rates, (2, 2))  # the default: 6
    for pool in POOLS:
        assert _turns_per_hour(limited, pool) == 6
    held = next(d for d in limited if "changes of direction in the last hour" in d.reasons["prefill"])
    assert held.targets["prefill"] == 2 and held.reasons["prefill"] == "holding at 2: 5 changes of direction in the last hour, of the 6 it may make"
    # It holds at the deployment, so it spends no more than the static split; once the oldest turns
    # are an hour old the pool turns down again.
    assert max(d.targets["prefill"] for d in limited) == 2
    assert [d.targets["prefill"] for d in limited if 300 < d.time_s < 3600] == [2] * 109
    assert any(d.targets["prefill"] == 1 for d in limited if d.time_s > 3600)
    # Above the deployment (replicas paid from savings) a pool goes down as before: deployed at 1 + 1.
    above = run(planner(**ALONE, **REMEMBER, scale_down_cooldown_s=0), rates, (1, 1))
    assert _turns_per_hour(above, "prefill") > 100
    with pytest.raises(ValueError, match="flap_limit_per_hour must be 0"):
        PlannerConfig(flap_limit_per_hour=-1)
