"""The window of per-interval counts the pools are sized for, and the levels of load it lets go.

Each interval's counts (replicas per pool, from ``ReplicaSizer.interval_counts``) join a window of
``window_s`` on the planner's clock; ``quantiles`` gives each count's ``base_quantile`` over it,
each interval weighted by its requests, and ``rises`` how far a count rose within a reaction:

    intervals, oldest first, each [time, aged, requests, counts]
    | counts | counts | None | None | None | counts | counts |  ──► per count, its quantile (``quantiles``)
                      └─ a level let go ─┘                     ──► per pool, its rises' quantile (``rises``)

A pool grown above a count (or held there by the deployment) starts a level (``track_level``); a
level that held longer than a burst and has been followed by two start-ups within that count is a
shift, not a burst to remember: ``release_levels`` forgets its intervals. Apart from the window,
each count's runs of intervals that needed it are kept: ``long_levels`` gives the counts whose run
ended less than ``level_memory_lengths`` times its length (and a reaction) ago, where that is
longer than the window, which the policy keeps below the deployment.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from planner.config import PlannerConfig
from planner.connector import POOLS
from planner.trend import rise_start_ups


@dataclass
class _Level:
    """A pool grown (or that would have grown, but for the deployment) above ``before`` replicas: when
    the current run of load that count does not carry began (None: between runs), and the intervals
    in a row since whose load it carries."""

    before: int
    run_s: float | None
    within: int = 0
    held: bool = False  # the deployment held the pool at ``before`` (burst_growth_above_deployment off)


class LoadWindow:
    """The request-weighted quantile window of per-interval counts and the levels the pools grew for.

    No clock of its own: it ages on the planner's (``add``'s ``aged_s``), so call ``add``, then
    ``release_levels``, once per interval, in order, and ``track_level`` per pool once it has settled.
    """

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.quantile = config.attainment_target if config.base_quantile is None else config.base_quantile
        derived_s = round(max(4 * config.interval_s, (config.startup_s + config.interval_s) / (1 - self.quantile)), 6)
        self.window_s = config.base_window_s if config.base_window_s is not None else derived_s
        self.level_memory_max_s = 4 * self.window_s if config.level_memory_max_s is None else config.level_memory_max_s
        self.warmup_s = min(self.window_s, derived_s)  # no pool shrinks before this much is observed
        # Every interval of the window's span in order: [time, aged, requests, counts]. A level let go
        # leaves its intervals' counts None: the window forgets them (``_remembered``), and no rise
        # within a reaction (a start-up and an interval: from a rise's first interval to the replicas
        # it asks for being warm) spans them.
        self._intervals: deque[list] = deque()
        self._reaction = max(1, math.ceil((config.startup_s + config.interval_s) / config.interval_s - 1e-9))
        self.intervals_per_start_up = max(1, math.ceil(config.startup_s / config.interval_s - 1e-9))
        # The start-ups a rise must last to be a trend the window cannot catch (``rise_start_ups``
        # overrides it for the trend rule, not for how long a level must hold).
        self.derived_start_ups = rise_start_ups(max(self.window_s / config.interval_s, 1 / (1 - config.attainment_target)))
        # Pools grown above a count, and the intervals in a row whose load that count carries. A run
        # that lasted long enough and is followed by two start-ups within the count is a level, let go.
        self._levels: dict[str, list[_Level]] = {pool: [] for pool in POOLS}  # outermost first
        self._steady = {pool: 0 for pool in POOLS}  # intervals in a row whose load the pool's target carries
        self.within_needed = 2 * self.intervals_per_start_up
        self.level_s = config.release_level_after_s
        if self.level_s is None:
            self.level_s = (self.derived_start_ups + 3) * self.intervals_per_start_up * config.interval_s
        # Per pool and count, the latest run of intervals whose count needed at least that many, as
        # [first, last] on the window's clock: a gap of two start-ups ends a run (``long_levels``);
        # and the ended run kept longest, as (kept until, held, ended), so that a blip in the quiet
        # after a level (a run of its own) does not end the level's memory.
        self._runs: dict[str, dict[int, list[float]]] = {pool: {} for pool in POOLS}
        self._ended: dict[str, dict[int, tuple[float, float, float]]] = {pool: {} for pool in POOLS}

    def add(self, now_s: float, aged_s: float, counts: dict[str, int], weight: int) -> None:
        """Adds one interval's counts (``weight``: its requests) to the window and drops those older
        than ``window_s`` on the planner's clock (``aged_s``: the seconds observed that age the window)."""
        window = self._intervals
        window.append([now_s, aged_s, max(weight, 1e-6), counts])
        while window[0][1] <= aged_s - self.window_s:
            window.popleft()
        if self.config.level_memory_lengths:
            self._track_runs(aged_s, counts)

    def _track_runs(self, aged_s: float, counts: dict[str, int]) -> None:
        """Extends or starts, per pool, the run of each count this interval's load needs (``long_levels``)."""
        gap_s = self.within_needed * self.config.interval_s + 1e-6
        for pool, runs in self._runs.items():
            most = self.config.max_prefill if pool == "prefill" else self.config.max_decode
            for count in range(1, min(counts[f"{pool}_down"], most) + 1):
                run = runs.get(count)
                if run is not None and aged_s - run[1] <= gap_s:
                    run[1] = aged_s
                    continue
                if run is not None:  # over: its memory outlives it, unless an earlier one's is longer
                    self._ended[pool][count] = max(self._kept(run), self._ended[pool].get(count, (-math.inf, 0.0, 0.0)))
                runs[count] = [aged_s, aged_s]

    def _remembered(self) -> list[list]:
        """The window's intervals, less those of the levels let go (the newest is always there)."""
        return [entry for entry in self._intervals if entry[3] is not None]

    def release_levels(self, now_s: float, counts: dict[str, int]) -> dict[str, str]:
        """Lets go of the levels the pools grew for: a run of intervals whose load (averaged over a
        start-up, at the scale-down margin) the count the pool had before does not carry, that lasted
        at least ``release_level_after_s`` and has been followed by two start-ups that count carries.
        The window forgets the run's intervals and a start-up either side of it (loads are averaged
        over a start-up), for both pools (the level was the load's, and the other pool's counts in it
        were the level's too), so each pool shrinks to what the load outside the level needs, as the
        settling rules allow. Returns a clause per pool let go (the caller forgets what the pool had
        before a trend's rise there: the level was that rise's too). A shorter run is a burst: the window
        remembers it, so one recurring finds its replicas warm, while a recurring level is caught
        again as it was the first time."""
        released, interval_s = {}, self.config.interval_s
        for pool, levels in self._levels.items():
            let_go = None
            for index, level in enumerate(levels):
                if counts[f"{pool}_down"] <= level.before:
                    level.within += 1
                else:
                    level.within = 0
                    if level.run_s is None:
                        level.run_s = now_s
                if level.run_s is None or level.within < self.within_needed:
                    continue
                if now_s - level.within * interval_s - level.run_s + interval_s < self.level_s:
                    level.run_s = None  # a burst: the window remembers it
                elif let_go is None:
                    let_go = index  # the outermost over; those inside it are over too
            if let_go is None:
                continue
            level = levels[let_go]
            del levels[let_go:]
            before, run_s = level.before, level.run_s
            ended_s = now_s - level.within * interval_s
            # Loads are averaged over a start-up, so a level's edges spread a start-up either side of it.
            edge_s = self.config.startup_s
            for entry in self._intervals:  # forgotten, and the level's rise with them: it was the shift's
                if run_s - edge_s <= entry[0] <= ended_s + edge_s:
                    entry[3] = None
            held_s = ended_s - run_s + interval_s
            held = f"{held_s / 60:.0f} minutes" if held_s >= 120 else f"{held_s:.0f} s"
            released[pool] = f"the level of {held} is over, {before} carried the last {level.within} intervals"
        return released

    def track_level(self, pool: str, current: int, target: int, count_down: int, held: bool, now_s: float) -> None:
        """Keeps ``pool``'s levels as it settles from ``current`` replicas to ``target``: one begins above
        ``current`` when the pool grows (or the deployment holds it there: ``held``) with no level yet
        or settled where it is, and those ``target`` is back down to end (at their count, unless held
        there). ``count_down``: the interval's count to shrink to."""
        # A pool whose load its target has carried for two start-ups has settled there: a rise
        # from it is a level of its own (the one it grew for before, if any, is its new normal).
        settled = self._steady[pool] >= self.within_needed  # before this interval
        self._steady[pool] = self._steady[pool] + 1 if count_down <= current else 0
        levels = self._levels[pool]
        # A run of load the deployment held the pool through is a level as much as one it grew for.
        held_here = held and target == current
        if (target > current or held_here) and (not levels or settled):
            # The run began where the load last left what the pool had: the window lets a rise in late.
            levels.append(_Level(current, self._run_began_s(pool, current, now_s), held=held_here))
        while levels and (target < levels[-1].before or (target == levels[-1].before and not levels[-1].held)):
            levels.pop()

    def _run_began_s(self, pool: str, before: int, now_s: float) -> float:
        """When the run of load that ``before`` replicas of ``pool`` do not carry, which the window
        ends with, began: the interval after the last two start-ups whose load they carried (``now_s``
        when the window ends with such a stretch; the window's first interval when it holds none)."""
        newer_s, after_stretch_s, within, remembered = now_s, now_s, 0, self._remembered()
        for time_s, _, _, counts in reversed(remembered):
            if counts[f"{pool}_down"] <= before:
                if not within:
                    after_stretch_s = newer_s
                within += 1
                if within >= self.within_needed:
                    return after_stretch_s
            else:
                within = 0
            newer_s = time_s
        return remembered[0][0]

    def quantiles(self) -> dict[str, int]:
        """Each count's quantile over the intervals of the last ``window_s``, each weighted by its
        requests (attainment is counted in requests, and a busy interval holds more of them)."""
        remembered = self._remembered()
        return {key: self._weighted_quantile([(c[key], w) for _, _, w, c in remembered]) for key in remembered[-1][3]}

    def rises(self) -> dict[str, int]:
        """Per pool, the quantile (as the window's, weighted by requests) of how far its count rose from
        an interval of the window's span within the reaction that followed it (a start-up and an
        interval), counting no rise that spans a level let go. Each rise weighs the requests of the
        busiest interval it rose to (``rises_weighted_at_peak``: those the room is for), else those
        of the interval it rose from. Empty until the window holds one reaction."""
        window, reaction = list(self._intervals), self._reaction
        spans = [window[i:i + reaction + 1] for i in range(len(window) - reaction)]
        spans = [span for span in spans if all(entry[3] is not None for entry in span)]
        if not spans:
            return {}
        at_peak = self.config.rises_weighted_at_peak
        weights = [max(e[2] for e in span[1:]) if at_peak else span[0][2] for span in spans]
        return {
            pool: self._weighted_quantile([(max(0, max(e[3][pool] for e in span[1:]) - span[0][3][pool]), w) for span, w in zip(spans, weights)])
            for pool in POOLS
        }

    def long_levels(self) -> dict[str, tuple[int, float, float]]:
        """Per pool, the highest count whose latest level, or an earlier one kept longer, is still
        kept (``level_memory_lengths`` times how long it held, and a reaction: a start-up and an
        interval, after it ended, where that is longer than the window), as (the count, how long it
        held, how long ago it ended): a blip in the quiet after a level does not end its memory.
        The window alone lets a level go a window after it ends. Counts are at the scale-down margin
        (``{pool}_down``), on the window's clock; a level's run allows gaps shorter than two
        start-ups."""
        if not self.config.level_memory_lengths or not self._intervals:
            return {}
        now_s, kept = self._intervals[-1][1], {}
        for pool, runs in self._runs.items():
            for count in sorted(runs, reverse=True):
                until_s, held_s, last = max(self._kept(runs[count]), self._ended[pool].get(count, (-math.inf, 0.0, 0.0)))
                if now_s < until_s:
                    kept[pool] = (count, held_s, now_s - last)
                    break
        return kept

    def _kept(self, run: list[float]) -> tuple[float, float, float]:
        """(kept until, held, ended) of a run [first, last]: kept ``level_memory_lengths`` times as long
        as it held and a reaction after it ended, where that is longer than the window (else kept
        until it ends: the window alone)."""
        first, last = run
        held_s = last - first + self.config.interval_s
        kept_s = min(self.config.level_memory_lengths * held_s + self._reaction * self.config.interval_s, self.level_memory_max_s)
        return last + (kept_s if kept_s > self.window_s else 0.0), held_s, last

    def _weighted_quantile(self, values: list[tuple[int, float]]) -> int:
        """The ``base_quantile`` of (value, weight) pairs (not empty)."""
        total, seen = sum(w for _, w in values), 0.0
        for value, w in sorted(values):
            seen += w
            if seen >= self.quantile * total - 1e-9:
                return value
        return max(value for value, _ in values)
