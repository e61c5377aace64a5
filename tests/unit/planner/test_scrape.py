"""The live planner's view of the routers: interval deltas of their real Prometheus exposition."""

import pytest
from prometheus_client import generate_latest

from planner.scrape import Scrape, count_above, interval, parse, quantile
from router.frontend.metrics import PROMPT_LENGTH_BUCKETS, RouterMetrics


def _exposition(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_two_routers_are_summed_and_an_interval_is_the_difference():
    a, b = RouterMetrics("router-0"), RouterMetrics("router-1")
    a.finished("OK")
    a.prompt_tokens.inc(100)
    before = parse(_exposition(b), 10.0, parse(_exposition(a), 10.0))
    for metrics in (a, b):
        metrics.finished("OK")
        metrics.prompt_tokens.inc(1000)
        metrics.output_tokens.inc(50)
        for _ in range(9):
            metrics.ttft.observe(0.2)
        metrics.ttft.observe(3.0)
    metrics.finished("UNAVAILABLE")
    after = parse(_exposition(b), 15.0, parse(_exposition(a), 15.0))

    stats = interval(before, after)
    assert stats.duration_s == 5.0
    assert (stats.requests, stats.prompt_tokens, stats.output_tokens) == (3, 2000, 100)
    assert 0.1 < stats.ttft_p90_s <= 0.25  # 18 of 20 observations fell in the (0.1, 0.25] bucket
    assert stats.ttft_mean_s == pytest.approx((18 * 0.2 + 2 * 3.0) / 20)
    assert stats.itl_p90_s is None and stats.itl_mean_s is None  # no inter-token latency observed


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile():
    before = {0.1: 0.0, 1.0: 0.0, float("inf"): 0.0}
    after = {0.1: 10.0, 1.0: 20.0, float("inf"): 20.0}
    assert quantile(0.5, before, after) == pytest.approx(0.1)
    assert quantile(0.75, before, after) == pytest.approx(0.55)  # halfway through (0.1, 1.0]
    assert quantile(0.9, {}, {}) is None
    assert quantile(0.99, before, {0.1: 0.0, 1.0: 0.0, float("inf"): 5.0}) == 1.0  # past the last bound


def test_count_above_is_exact_at_a_bound_and_linear_within_a_bucket():
    before = {0.1: 2.0, 1.0: 2.0, float("inf"): 2.0}
    after = {0.1: 12.0, 1.0: 22.0, float("inf"): 26.0}  # 10 at or below 0.1, 10 in (0.1, 1.0], 4 above 1.0
    assert count_above(1.0, before, after) == pytest.approx(4)
    assert count_above(0.1, before, after) == pytest.approx(14)
    assert count_above(0.55, before, after) == pytest.approx(9)  # half of (0.1, 1.0]'s 10, and the 4
    assert count_above(0.05, before, after) == pytest.approx(19)  # half of [0, 0.1]'s 10 too
    assert count_above(5.0, before, after) == pytest.approx(4)  # past the last finite bound: all above it
    assert count_above(1.0, {}, {}) is None  # the series is not exported


def test_a_requests_mean_inter_token_latency_is_read_from_the_routers_histogram():
    metrics = RouterMetrics("router-0")
    before = parse(_exposition(metrics), 0.0)
    for mean_s in (0.02, 0.04, 0.3):
        metrics.request_inter_token.observe(mean_s)
    after = parse(_exposition(metrics), 30.0)
    assert count_above(0.1, before.buckets["request_itl"], after.buckets["request_itl"]) == 1


def test_a_restarted_router_never_gives_negative_counts():
    before = Scrape(0.0, counters={"requests": 50.0})
    after = Scrape(10.0, counters={"requests": 3.0})
    assert interval(before, after).requests == 0.0


def test_prompt_lengths_of_the_interval_are_counted_per_bucket():
    a, b = RouterMetrics("router-0"), RouterMetrics("router-1")
    a.prompt_length.observe(100)  # before the interval: not counted
    before = parse(_exposition(b), 10.0, parse(_exposition(a), 10.0))
    for length in (100, 128, 129, 300_000):
        a.prompt_length.observe(length)
    for length in (181, 200_000, 300_000):
        b.prompt_length.observe(length)
    after = parse(_exposition(b), 15.0, parse(_exposition(a), 15.0))

    counts = interval(before, after).prompt_length_counts
    assert [bound for bound, _ in counts] == list(PROMPT_LENGTH_BUCKETS)
    assert {bound: n for bound, n in counts if n} == {
        128.0: 2,  # 100 and 128: a bucket's bound is inclusive
        2 ** 7.5: 2,  # 129 and 181
        2.0 ** 18: 1,  # 200,000, in (185,364, 262,144]
        float("inf"): 2,  # 300,000 twice: past the last finite bound
    }


def test_no_prompt_length_histogram_gives_no_counts():
    assert interval(Scrape(0.0), Scrape(10.0)).prompt_length_counts == ()
