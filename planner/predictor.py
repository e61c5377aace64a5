"""Next-interval load: request rate and prompt and output token rates.

Each series is smoothed with Holt's method on the logarithm of the rate (a level and a
multiplicative trend, both EWMAs: the growth per interval) and forecast ``horizon`` intervals
ahead: ``max(level, level * growth ** horizon)``. A burst grows by a factor per interval, not by
a fixed step (on the bursty replays in bench.planner a linear trend met steep ramps one start-up
late and lost 5-13 points of SLO attainment that the multiplicative one keeps). The horizon is
the time a replica asked for now takes to serve (one interval plus its start-up), so a ramp is
met by replicas that are warm when it arrives. A falling trend never pulls the forecast below
the level: the pools shrink only as fast as the level decays, and the policy's hysteresis and
cooldown hold them back further. Token rates are forecast directly rather than rate times mean
length, so a burst of long prompts at a steady request rate is seen as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadForecast:
    """The load expected in the next interval."""

    request_rate: float
    """Requests per second."""
    prompt_tokens_per_s: float
    """Prompt tokens arriving per second."""
    output_tokens_per_s: float
    """Tokens the decode pool generates per second (each request's first token comes out of its prefill)."""

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens_per_s / self.request_rate if self.request_rate > 0 else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens_per_s / self.request_rate if self.request_rate > 0 else 0.0


MAX_GROWTH = math.log(2.0)
"""The fastest growth a trend may project: a doubling per interval (a step up is not a trend)."""

SEED_OBSERVATIONS = 2
"""Observations that only set the level: the first interval a planner sees is usually partial (it
started mid-interval, or a replayed trace starts mid-window), and a trend taken from it is
noise. On the Azure conv trace 59 requests then 132 read as a 5x growth in output tokens, and
the doubling-capped projection sized decode at 4 replicas where 1 served (0.25 of 2.88
replica-hours, held by the cooldown). The trend starts from the second difference."""


class _Holt:
    """Holt's level and trend on log(1 + rate): the trend is a growth factor per interval."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0
        self.count = 0

    def add(self, value: float) -> None:
        x = math.log1p(max(0.0, value))
        self.count += 1
        if self.count <= SEED_OBSERVATIONS:
            self.level = x
            return
        level = self.alpha * x + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
        self.level = level

    def forecast(self, horizon: float) -> float:
        if self.level is None:
            return 0.0
        return math.expm1(self.level + horizon * min(MAX_GROWTH, max(0.0, self.trend)))


class LoadPredictor:
    """Forecasts the load ``horizon`` intervals ahead from the intervals observed so far (module docstring)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, horizon: float = 3.0) -> None:
        self.horizon = horizon
        self._series = [_Holt(alpha, beta) for _ in range(3)]

    def observe(self, request_rate: float, prompt_tokens_per_s: float, output_tokens_per_s: float) -> None:
        """Adds one interval's measured rates."""
        for series, value in zip(self._series, (request_rate, prompt_tokens_per_s, output_tokens_per_s)):
            series.add(value)

    def forecast(self) -> LoadForecast:
        """The load ``horizon`` intervals ahead; all zeros before the first observation."""
        return LoadForecast(*(s.forecast(self.horizon) for s in self._series))
