"""PlannerConfig refuses settings that make no sense, in a sentence naming the field."""

from __future__ import annotations

import pytest

from planner.config import PlannerConfig


def test_defaults_are_valid():
    config = PlannerConfig()
    assert (config.ttft_slo_s, config.itl_slo_s, config.min_prefill, config.min_decode) == (2.0, 0.1, 0, 1)


@pytest.mark.parametrize("fields, message", [
    ({"ttft_slo_s": 0}, "ttft_slo_s must be above 0 seconds, got 0."),
    ({"interval_s": -1}, "interval_s must be above 0 seconds, got -1."),
    ({"attainment_target": 1.0}, "attainment_target must be between 0 and 1 (exclusive), got 1.0."),
    ({"min_prefill": 3, "max_prefill": 2}, "min_prefill and max_prefill must satisfy 0 <= min <= max and max >= 1, got 3 and 2."),
    ({"min_decode": 0}, "min_decode and max_decode must satisfy 1 <= min <= max, got 0 and 16."),
    ({"scale_down_margin": 1.5}, "scale_down_margin must be in (0, 1], got 1.5."),
    ({"decode_scale_down_margin": 0}, "decode_scale_down_margin must be in (0, 1], got 0."),
    ({"prefill_zero_load": 1.0}, "prefill_zero_load must be in [0, 1) prefill replicas, got 1.0."),
    ({"correction_min": 1.2}, "correction_min and correction_max must satisfy 0 < min <= 1 <= max, got 1.2 and 2.0."),
    ({"startup_s": -5}, "startup_s must be 0 or more, got -5."),
    ({"idle_hold_s": -1}, "idle_hold_s must be 0 or more, got -1."),
    ({"scale_down_cooldown_s": float("nan")}, "scale_down_cooldown_s must be 0 or more, got nan."),
    ({"rise_step_below_deployment": 0.5}, "rise_step_below_deployment must be 1 or more, got 0.5."),
    ({"rise_step_below_deployment": float("nan")}, "rise_step_below_deployment must be 1 or more, got nan."),
])
def test_refusals(fields, message):
    with pytest.raises(ValueError) as e:
        PlannerConfig(**fields)
    assert str(e.value) == message
