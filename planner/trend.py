"""Trends in the observed load: start-up averages that rise over each of the last k start-ups.

The planner's window (``window.LoadWindow``) catches a rise a start-up and an interval late; a load that keeps
rising outruns it. ``LoadTrend`` keeps each pool's observed load (in replicas) of the last
(k + 1) start-ups, averages it per start-up, newest block ending at the newest interval:

    intervals  | i-9 i-8 | i-7 i-6 | i-5 i-4 | i-3 i-2 | i-1  i  |   (two intervals a start-up, k = 4)
    averages   |   m0    |   m1    |   m2    |   m3    |   m4    |   a rise: m0 < m1 < m2 < m3 < m4

and projects a rising one at the mean rise a start-up, (m4 - m0) / k, to the middle of the first
interval that replicas asked for now serve; or, ``geometric``, at the mean growth a start-up,
(m4 / m0) ** (1 / k), as a surge grows (a projection below the deployment, where overshooting
costs nothing a static split would not spend). A surge that accelerates outgrows its start-up
averages: ``latest`` also projects a load that rose in each of the last two intervals at their
growth an interval, (l_i / l_i-2) ** (1 / 2), from the newest interval's middle, and takes the
larger projection. A rise whose newest interval, l_i, is back at or below m0 is over.
"""

from __future__ import annotations

import math
from collections import deque

from planner.connector import POOLS


def rise_start_ups(num_checks: float) -> int:
    """The fewest k whose (k + 1)! reaches ``num_checks``: k + 1 start-ups of noise alone rise k times
    in a row with chance 1 / (k + 1)!, so about once in that many intervals (each one tests it)."""
    k = 1
    while math.factorial(k + 1) < num_checks:
        k += 1
    return k


class LoadTrend:
    """Each pool's observed load of the last ``num_start_ups + 1`` start-ups of
    ``intervals_per_start_up`` intervals each; ``num_start_ups`` 0 never reports a rise."""

    def __init__(
        self, intervals_per_start_up: int, num_start_ups: int, startup_s: float, interval_s: float, geometric: bool = False, latest: bool = False
    ) -> None:
        if latest and not geometric:
            raise ValueError("latest projects at a growth rate: it needs geometric")
        self.num_start_ups = num_start_ups
        self.geometric = geometric
        self.latest = latest
        self.at_latest: frozenset[str] = frozenset()  # the pools the last ``rises`` projected at their latest growth
        self._block = intervals_per_start_up
        self._loads: deque[tuple[float, float]] = deque(maxlen=intervals_per_start_up * (num_start_ups + 1))
        # From the middle of the newest block to the middle of the first interval replicas asked for now
        # serve (a start-up and half an interval from now), in start-ups.
        self._ahead = (startup_s + interval_s / 2 + intervals_per_start_up * interval_s / 2) / (intervals_per_start_up * interval_s)
        # From the middle of the newest interval to the same point, in intervals.
        self._ahead_intervals = (startup_s + interval_s) / interval_s

    def observe(self, loads: tuple[float, float]) -> None:
        """Adds one interval's observed load, in replicas, of each pool in ``POOLS`` order."""
        self._loads.append(loads)

    def rises(self) -> dict[str, float]:
        """Per pool whose load rose over each of the last ``num_start_ups`` start-ups, and whose newest
        interval is still above the oldest start-up's mean (the rise is not over), that load
        projected at its mean rise a start-up (``geometric``: its mean growth, or its rise when it
        grew from nothing; with ``latest`` too, at the growth of its last two intervals where each
        rose, whichever projects more, naming the pools it did in ``at_latest``); nothing until that
        many start-ups are observed."""
        self.at_latest = frozenset()
        if not self.num_start_ups or len(self._loads) < self._loads.maxlen:
            return {}
        out, at_latest = {}, set()
        newest = list(self._loads)[-3:] if self.latest else []  # the last three intervals, both pools
        for index, pool in enumerate(POOLS):
            means = self._means(index)
            # A rise whose newest interval is back at or below where it rose from is over: a burst
            # between idle intervals makes rising start-up means out of one busy interval, and its
            # growth from a near-empty start-up projects many times the load that was ever there.
            if all(b > a for a, b in zip(means, means[1:])) and self._loads[-1][index] > means[0]:
                steps = len(means) - 1
                if self.geometric and means[0] > 0:
                    out[pool] = means[-1] * (means[-1] / means[0]) ** (self._ahead / steps)
                else:
                    out[pool] = means[-1] + (means[-1] - means[0]) / steps * self._ahead
                last = [x[index] for x in newest]
                if len(last) == 3 and 0 < last[0] < last[1] < last[2]:
                    projected = last[2] * (last[2] / last[0]) ** (self._ahead_intervals / 2)
                    if projected > out[pool]:
                        out[pool] = projected
                        at_latest.add(pool)
        self.at_latest = frozenset(at_latest)
        return out

    def falling(self, pool: str) -> bool:
        """Whether ``pool``'s load of the last start-up is below that of the start-up before."""
        means = self._means(POOLS.index(pool))
        return len(means) >= 2 and means[-1] < means[-2]

    def _means(self, index: int) -> list[float]:
        loads, block = [x[index] for x in self._loads], self._block
        return [sum(loads[i : i + block]) / block for i in range(len(loads) % block, len(loads), block)]
