"""LoadTrend: start-up averages of the observed load, the rise test and its projection, by hand."""

from __future__ import annotations

import pytest

from planner.trend import LoadTrend, rise_start_ups


def trend_of(prefill_loads, num_start_ups: int = 2) -> LoadTrend:
    """Two 30 s intervals a start-up of 60 s; decode's load held at 1 replica."""
    trend = LoadTrend(2, num_start_ups, 60.0, 30.0)
    for load in prefill_loads:
        trend.observe((load, 1.0))
    return trend


def test_the_fewest_start_ups_whose_factorial_reaches_the_checks():
    assert [rise_start_ups(n) for n in (1, 2, 3, 6, 7, 20, 24, 25, 60, 120, 121)] == [1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5]


def test_a_load_rising_over_each_start_up_is_projected_at_its_mean_rise():
    # Start-up means 1.5, 3.5, 5.5: a rise of 2 a start-up, projected from the newest mean's middle
    # (30 s before now) to 75 s after now, 105 s = 1.75 start-ups: 5.5 + 2 x 1.75 = 9.
    trend = trend_of([1, 2, 3, 4, 5, 6])
    assert trend.rises() == {"prefill": pytest.approx(9.0)}  # decode's flat load is no rise
    assert not trend.falling("prefill")


def test_a_geometric_trend_is_projected_at_its_mean_growth_and_from_nothing_at_its_rise():
    # Start-up means 1, 2, 4: twice a start-up, so 1.75 start-ups ahead 4 x 2 ** 1.75 = 13.45
    # (at the mean rise, 4 + 1.5 x 1.75 = 6.6).
    trend = LoadTrend(2, 2, 60.0, 30.0, geometric=True)
    for load in (1, 1, 2, 2, 4, 4):
        trend.observe((load, 1.0))
    assert trend.rises() == {"prefill": pytest.approx(4 * 2**1.75)}
    # A load that grew from none has no growth rate: its rise is projected, as without geometric.
    from_nothing = LoadTrend(2, 1, 60.0, 30.0, geometric=True)
    for load in (0, 0, 1, 3):
        from_nothing.observe((load, 0.0))
    assert from_nothing.rises() == {"prefill": pytest.approx(2 + 2 * 1.75)}


def test_a_rise_whose_newest_interval_is_back_where_it_rose_from_is_over():
    # A burst of one busy interval between idle ones (as Azure's code trace has): start-up means
    # 0.005 and 0.125 grow 25x, which would project 0.125 x 25 ** 1.75 = 35 replicas on an empty
    # interval. Its newest interval, 0, is below the first mean: no rise.
    burst = LoadTrend(2, 1, 60.0, 30.0, geometric=True)
    for load in (0.0, 0.01, 0.25, 0.0):
        burst.observe((load, 0.0))
    assert burst.rises() == {}
    # Still above where it rose from, the same rise is projected as before.
    going_on = LoadTrend(2, 1, 60.0, 30.0, geometric=True)
    for load in (0.0, 0.01, 0.25, 0.02):
        going_on.observe((load, 0.0))
    assert going_on.rises() == {"prefill": pytest.approx(0.135 * (0.135 / 0.005) ** 1.75)}
    # The arithmetic trend keeps the same test: means 1 and 3, newest back at 1.
    assert trend_of([1, 1, 5, 1], num_start_ups=1).rises() == {}
    assert trend_of([1, 1, 5, 1.5], num_start_ups=1).rises() == {"prefill": pytest.approx(3.25 + 2.25 * 1.75)}


def test_nothing_is_a_rise_before_every_start_up_is_observed_or_when_off():
    assert trend_of([1, 2, 3, 4, 5]).rises() == {}
    assert trend_of([1, 2, 3, 4, 5, 6], num_start_ups=0).rises() == {}


def test_a_step_rises_over_two_start_ups_only():
    # A step in the middle of a start-up: means 1, 3, 5, 5; with three rises asked for, no trend.
    assert trend_of([1, 1, 1, 5, 5, 5, 5, 5], num_start_ups=3).rises() == {}
    assert trend_of([1, 1, 1, 5, 5, 5], num_start_ups=2).rises() == {"prefill": pytest.approx(5 + 2 * 1.75)}


def test_the_blocks_end_at_the_newest_interval_and_a_lower_newest_block_is_falling():
    trend = trend_of([1, 2, 3, 4, 5, 6, 5])  # means (2, 3), (4, 5), (6, 5): 2.5, 4.5, 5.5
    assert trend.rises() == {"prefill": pytest.approx(5.5 + 1.5 * 1.75)}
    trend.observe((3, 1.0))  # means 3.5, 5.5, 4
    assert trend.rises() == {} and trend.falling("prefill") and not trend.falling("decode")


def test_latest_projects_a_load_rising_in_each_of_its_last_two_intervals_at_their_growth():
    # Intervals 4, 5, 6, 9: start-up means 4.5 and 7.5 project 7.5 x (7.5 / 4.5) ** 1.75 = 18.3;
    # the last three rose each, 5 to 9 over two intervals, which from the newest interval's middle
    # to a start-up and half an interval ahead (3 intervals) is 9 x (9 / 5) ** 1.5 = 21.7.
    def rises(loads, latest):
        trend = LoadTrend(2, 1, 60.0, 30.0, geometric=True, latest=latest)
        for load in loads:
            trend.observe((load, 1.0))
        return trend.rises()

    assert rises([4, 5, 6, 9], latest=True) == {"prefill": pytest.approx(9 * 1.8**1.5)}
    trend = LoadTrend(2, 1, 60.0, 30.0, geometric=True, latest=True)
    for load in (4, 5, 6, 9):
        trend.observe((load, 1.0))
    trend.rises()
    assert trend.at_latest == {"prefill"}
    assert rises([4, 5, 6, 9], latest=False) == {"prefill": pytest.approx(7.5 * (7.5 / 4.5) ** 1.75)}
    # The larger projection is taken: a start-up's growth above its last two intervals' stands.
    assert rises([1, 1, 5, 6], latest=True) == rises([1, 1, 5, 6], latest=False) == {"prefill": pytest.approx(5.5 * 5.5**1.75)}
    # Not rising in each of the last two intervals (6 then 5), or no start-up rise: the start-up's alone.
    assert rises([4, 6, 5, 9], latest=True) == rises([4, 6, 5, 9], latest=False)
    for load in (1, 1, 5, 6):  # the start-up's growth projects more: not named
        trend.observe((load, 1.0))
    trend.rises()
    assert trend.at_latest == frozenset()
    assert rises([6, 6, 4, 5], latest=True) == {}
    with pytest.raises(ValueError, match="needs geometric"):
        LoadTrend(2, 1, 60.0, 30.0, latest=True)
