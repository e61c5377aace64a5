"""The SLO's error budget: how many more requests may miss an SLO over the last window.

The planner grows a pool above its deployment for a shift only once this budget is spent
(``PlannerConfig.error_budget_above_deployment``): until then a static split of the deployment
would have served the load within the attainment target too.
"""

from __future__ import annotations

from collections import deque

from planner.config import PlannerConfig


class ErrorBudget:
    """``1 - attainment_target`` of the requests of the last ``error_budget_window_s``, less those
    that missed an SLO. Fed once per interval, in order, by ``observe``."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        # (time, requests, misses) of each interval of the window whose observation counted the
        # requests that missed an SLO.
        self._intervals: deque[tuple[float, int, int]] = deque()
        self._began_s: float | None = None  # when the first interval observed began

    def observe(self, time_s: float, duration_s: float, num_requests: int, misses: int | None) -> None:
        """Adds the interval that ended at ``time_s`` (``misses``: None when the observation did not
        count them) and drops those older than the window."""
        if self._began_s is None:
            self._began_s = time_s - duration_s
        if misses is not None:
            self._intervals.append((time_s, num_requests, misses))
        while self._intervals and self._intervals[0][0] <= time_s - self.config.error_budget_window_s:
            self._intervals.popleft()

    def remaining(self) -> float | None:
        """Requests that may still miss an SLO over the window before the budget is spent (below 0:
        overspent); None when it holds nothing (off, or no observation counted the misses). Until a
        whole window has been watched, its requests are those seen at their rate so far
        (``error_budget_extrapolated``)."""
        config = self.config
        if not config.error_budget_above_deployment or not self._intervals:
            return None
        requests = sum(n for _, n, _ in self._intervals)
        watched_s = self._intervals[-1][0] - self._began_s
        if config.error_budget_extrapolated and 0 < watched_s < config.error_budget_window_s:
            requests *= config.error_budget_window_s / watched_s
        return (1 - config.attainment_target) * requests - sum(m for _, _, m in self._intervals)

    def unspent_clause(self, budget: float) -> str:
        """The reason's clause for a pool held while the budget (``budget`` requests) is not spent."""
        return (
            f" the SLO's error budget is not spent: {budget:.0f} more requests of the last"
            f" {self.config.error_budget_window_s:g} s may miss ({1 - self.config.attainment_target:.2g} of them)"
        )
