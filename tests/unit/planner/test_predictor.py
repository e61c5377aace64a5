"""The load predictor: steady load forecast as is, a ramp met ahead, a fall never below the level,
no trend read into the first (partial) interval."""

from __future__ import annotations

import math

import pytest

from planner.predictor import LoadForecast, LoadPredictor


def test_nothing_observed_forecasts_zero():
    assert LoadPredictor().forecast() == LoadForecast(0.0, 0.0, 0.0)


def test_a_steady_load_is_forecast_exactly():
    predictor = LoadPredictor(alpha=0.5, beta=0.3, horizon=3)
    for _ in range(5):
        predictor.observe(4.0, 4000.0, 800.0)
    forecast = predictor.forecast()
    assert (forecast.request_rate, forecast.prompt_tokens_per_s, forecast.output_tokens_per_s) == pytest.approx((4.0, 4000.0, 800.0))
    assert forecast.mean_prompt_tokens == pytest.approx(1000.0) and forecast.mean_output_tokens == pytest.approx(200.0)


def test_the_first_interval_only_seeds_the_level_and_projects_no_trend():
    """A planner's first interval is usually partial: 1 then 99 requests/s is not a 50x growth."""
    predictor = LoadPredictor(alpha=0.5, beta=0.5, horizon=3)
    predictor.observe(1.0, 100.0, 10.0)
    predictor.observe(99.0, 9900.0, 990.0)
    assert predictor.forecast() == LoadForecast(pytest.approx(99.0), pytest.approx(9900.0), pytest.approx(990.0))
    predictor.observe(99.0, 9900.0, 990.0)  # steady from there: still no growth
    assert predictor.forecast().request_rate == pytest.approx(99.0)


def _seeded(alpha: float, beta: float) -> LoadPredictor:
    """A predictor past its first (partial, seeding) interval, whose value the next one replaces."""
    predictor = LoadPredictor(alpha=alpha, beta=beta, horizon=3)
    predictor.observe(12345.0, 0.0, 0.0)
    return predictor


def test_a_rise_is_extrapolated_as_growth_over_the_horizon():
    predictor = _seeded(alpha=0.5, beta=0.3)
    predictor.observe(9.0, 0.0, 0.0)
    predictor.observe(99.0, 0.0, 0.0)
    # On log(1 + rate): level ln(10 * 100) / 2 = ln(31.6), trend 0.3 * ln(3.16) per interval,
    # three intervals ahead: 31.6 * 3.16 ** 0.9 - 1
    expected = math.sqrt(1000.0) * math.sqrt(10.0) ** 0.9 - 1
    assert predictor.forecast().request_rate == pytest.approx(expected)
    assert predictor.forecast().request_rate > math.sqrt(1000.0) - 1  # ahead of the level


def test_a_steady_growth_factor_is_met_ahead():
    """A load doubling every interval is forecast well above its last value (a linear trend lags)."""
    predictor = LoadPredictor(alpha=0.5, beta=0.5, horizon=3)
    for k in range(8):
        predictor.observe(2.0**k, 0.0, 0.0)
    assert predictor.forecast().request_rate > 2.0**7


def test_a_fall_keeps_the_level():
    predictor = _seeded(alpha=0.5, beta=0.3)
    predictor.observe(99.0, 0.0, 0.0)
    predictor.observe(9.0, 0.0, 0.0)
    assert predictor.forecast().request_rate == pytest.approx(math.sqrt(1000.0) - 1)  # level only, falling trend ignored


def test_a_step_up_projects_at_most_a_doubling_per_interval():
    predictor = _seeded(alpha=0.5, beta=0.5)
    predictor.observe(49.0, 0.0, 0.0)
    predictor.observe(9999.0, 0.0, 0.0)
    # level: the geometric mean of 50 and 10,000 (on 1 + rate); the 14x growth is capped at 2x per interval
    assert predictor.forecast().request_rate == pytest.approx(math.sqrt(50 * 10_000) * 2**3 - 1)
