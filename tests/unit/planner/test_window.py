"""LoadWindow's rises, read directly: the room below the deployment is kept for (SLAPlanner's
decisions on it are in test_policy.py).

Intervals of 30 s and a start-up of 60 s: a reaction is three intervals, so a rise is read over
spans of four (the interval it rose from and the three after it), and the window (1800 s) holds
sixty intervals and 57 such spans.
"""

from __future__ import annotations

from planner.config import PlannerConfig
from planner.window import LoadWindow


def window_with_one_rise(**fields) -> LoadWindow:
    """Thirty minutes of 100 requests an interval at one prefill replica, but for a quiet spell of
    three intervals at 50 requests and then one of 300 that needs four: 4.8% of the window's
    requests, which its quantile leaves out."""
    window = LoadWindow(PlannerConfig(interval_s=30.0, startup_s=60.0, **fields))
    for i in range(60):
        count = 4 if i == 40 else 1
        requests = 300 if i == 40 else (50 if 37 <= i < 40 else 100)
        window.add(30.0 * (i + 1), 30.0 * (i + 1), {"prefill": count, "decode": 1, "prefill_down": count, "decode_down": 1}, requests)
    return window


def test_a_rise_out_of_a_quiet_spell_weighs_the_requests_it_rose_to():
    window = window_with_one_rise()
    assert window.quantiles()["prefill"] == 1  # the burst's own interval is under the 5% left out
    # The three spans that rose by 3 weigh the burst's 300 requests each: 900 of about 6,300.
    assert window.rises() == {"prefill": 3, "decode": 0}
    # Weighed by the quiet intervals they rose from (50 each), they are 150 of about 5,600, under
    # the 5% the quantile leaves out: no room for the rise that would catch a pool shrunk there.
    assert window_with_one_rise(rises_weighted_at_peak=False).rises() == {"prefill": 0, "decode": 0}
