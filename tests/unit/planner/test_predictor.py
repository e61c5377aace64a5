"""The load predictor: steady load forecast as is, a ramp met ahead, a fall never below the level."""

from __future__ import annotations

import pytest

from planner.predictor import LoadForecast, LoadPredictor


def test_nothing_observed_forecasts_zero():
    assert LoadPredictor().forecast() == LoadForecast(0.0, 0.0, 0.0)


def test_a_steady_load_is_forecast_exactly():
    predictor = LoadPredictor(alpha=0.5, beta=0.3, horizon=3)
    for _ in range(5):
        predictor.observe(4.0, 4000.0, 800.0)
    forecast = predictor.forecast()
    assert forecast == LoadForecast(4.0, 4000.0, 800.0)
    assert forecast.mean_prompt_tokens == 1000.0 and forecast.mean_output_tokens == 200.0


def test_a_rise_is_extrapolated_over_the_horizon():
    predictor = LoadPredictor(alpha=0.5, beta=0.3, horizon=3)
    predictor.observe(10.0, 0.0, 0.0)
    predictor.observe(30.0, 0.0, 0.0)
    # level 20, trend 0.3 * 10 = 3, three intervals ahead: 29
    assert predictor.forecast().request_rate == pytest.approx(29.0)


def test_a_fall_keeps_the_level():
    predictor = LoadPredictor(alpha=0.5, beta=0.3, horizon=3)
    predictor.observe(30.0, 0.0, 0.0)
    predictor.observe(10.0, 0.0, 0.0)
    assert predictor.forecast().request_rate == pytest.approx(20.0)  # level 20, trend -3 ignored
