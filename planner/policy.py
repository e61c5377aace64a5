"""The SLA planner's decision: how many prefill and decode replicas the next interval needs.

Every interval the live loop (or bench.planner's replay) hands ``SLAPlanner.decide`` one
``Observation`` and the pools as the connector sees them, and applies the ``Decision``'s targets.

    observation ──► load averaged over a start-up ──► count per pool ──► window of counts ──► quantile ─┐
         │                                            (Erlang C / ITL)  (startup / (1 - target))          ├─► settle ──► targets
         ├──► prompt-length histogram: infeasible prompts apart, cost per token, spread                  │  (warm-up, hysteresis,
         └──► observed/predicted latency ──► corrections (clamped, smoothed)          backlog ────────────┘   cooldown, min/max)

A replica asked for now is warm a start-up later, so the pools are sized for what they recently had
to carry, not chased after each rise: each interval's observed load, averaged over the last start-up
(a shorter burst counts at its share), becomes a count per pool, and the pools are sized for the
request-weighted ``attainment_target`` quantile of the counts over a window of ``(startup_s +
interval_s) / (1 - attainment_target)``. A rise enters that quantile once it holds ``1 -
attainment_target`` of the window's requests, about a start-up and an interval for a rise at the
window's rate; a burst seen is remembered for the window.
A load that has risen over each of the last k start-ups (k the fewest with (k + 1)! at least the
window's intervals and 1 / (1 - attainment_target): noise alone rises so often at most about once a
window and in at most the miss share of the intervals) is a trend the window cannot catch: the pool
grows at once to the load projected to the middle of the first interval that replicas asked for now
serve, and goes back to what it had (or what the window needs) once the load falls. A projection
above what the load itself needs is a bet: unless that load already needs more than the deployment
the planner started over (the pools' first targets), it is paid from the replica-seconds the pools
have spent below that deployment (``trend_bets_from_savings``), so the planner is not above its
deployment on a guess it has not saved for.
A pool goes below its deployment only once an interval's load has needed the deployment's count,
or after ``hold_deployment_until_needed_s`` observed (launch protection; no limit by default):
until the load has reached the deployment the window has seen nothing of how it rises to it.
Below the deployment each pool also keeps room for the load's own rises (``rise_room_below_deployment``):
the count it needs now plus the quantile (as the window's) of how far its count rose from an
interval of the window's span within the start-up and interval after it, at most the deployment;
the quantile leaves a burst out, and replicas up to the deployment cost nothing a static split
would not. A level let go takes its rise with it.
Below the deployment a level of load is also kept for twice as long after it ended as it held,
where that is longer than the window (``level_memory_lengths``), and four windows at most
(``level_memory_max_s``): the window alone lets a level go a window after it ends, just as a load
with a period of twice the window brings it back; a level of hours, a day's peak, is let go in the
trough.
Below the deployment a load that rose over the last start-up is met ahead at once
(``rise_ahead_below_deployment``): the pool grows to the load grown on at that rate to when
replicas asked for now are warm, at most the deployment, and holds that while the load rises.
So are answers that lengthen (``lengthening_ahead_below_deployment``): a running count above what the
request rate keeps at the window's longest run time (Little's law), past its Poisson swing, grows
the decode pool for that count grown on at its last growth, before the decoded tokens show it.
Below the deployment a pool that must grow asks for twice the step from its target to what it
needs (``rise_step_below_deployment``), at most the deployment: a rise mostly goes on for the
start-up its replicas take, and up to the deployment they cost nothing a static split would not.
Above the deployment the planner rides a burst out as a static split of that size would
(``burst_growth_above_deployment`` off): a pool grows past it only for load that has needed more in
each interval of the last two start-ups and still does in this one alone (a shift, which replicas
asked for now still catch; a shorter burst is mostly over by the time they are warm), or when the
replica-seconds saved below the deployment pay for the replicas added, for a start-up and an
interval (the payment is spent). A shift, and a KV pool nearly full, grow a pool past the
deployment only once the SLO's error budget is spent (``error_budget_above_deployment``): the
requests that missed an SLO over the last ``error_budget_window_s`` reach ``1 - attainment_target``
of them. Until then the deployment serves them as a static split of it would, within the SLO.
A level the pool grew for (or was held through at the deployment) that held longer than a burst
(``release_level_after_s``: the trend test's span and two start-ups more) is a shift in load, not a
burst to remember: once the load has been within the count the pool had before for two start-ups,
the window forgets the level's intervals and both pools shrink to what the load outside it needs.
Prefill: the fewest replicas sharing one queue (the router picks the least queued) whose Erlang-C
wait tail keeps ``1 - attainment_target`` of prompts over the TTFT SLO, waits scaled by (1 + cv^2) / 2
of the prompts' prefill times and by the correction c_p (observed mean TTFT over the model's). A
prompt whose prefill alone exceeds the SLO is counted apart and never drives the pool to max: the
mean prompt and its spread are the others', and its work counts in the load (it holds a replica the
others would wait for) only while the others are load enough for a prefill replica; nor, without
them, does the KV it fills grow decode.
Decode: the largest batch whose corrected ITL meets the SLO, less each replica's share of the
pool's Poisson swing (z * sqrt(batch / n) for n replicas, z at the attainment target: the router
joins each sequence to the smallest batch, so the pool's sequences swing as one count), sets one
replica's token rate; a trend is projected at each replica's own swing, z * sqrt(batch). The
load is the decoded tokens (streamed, less each request's first, which its prefill makes) over that
rate, or the running sequences over that batch when more (but sequences piled up behind batches
stalled by their replicas' own prefills are a backlog: the pool grows for them now, and the window
takes the decoded tokens). Prompts queued behind a prefill backlog are sequences on their way: the
decode pool grows now for them and the running ones, outside the window.
When the prompt load is under ``prefill_zero_load`` replicas the prefill pool may go to zero and
that load is added to the decode pool's; a pool at zero stays so while the decode replicas, each
prefilling its share, carry it all. With ``aggregate_when_cheaper`` it also goes to zero
whenever n decode replicas serving everything cost less than the two pools: each then spends
s = prefill load / n of its time prefilling with its batch stalled, so it must keep ITL within
(1 - s) of the SLO and makes (1 - s) of its tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.budget import ErrorBudget
from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.observation import Decision, Observation
from planner.perf_model import PerfModel
from planner.predictor import LoadForecast, LoadPredictor
from planner.sizing import ReplicaSizer
from planner.trend import LoadTrend
from planner.window import LoadWindow


@dataclass
class _Interval:
    """One interval as ``SLAPlanner.decide``'s steps read it: the observation, the pools as they are,
    what ``_observe`` took in and the load ``_size_load`` sized (set once, read after)."""

    obs: Observation
    pools: Mapping[str, PoolReplicas]
    observed: LoadForecast  # the interval's own rates (decoded tokens: less each request's first)
    forecast: LoadForecast
    infeasible_requests: int
    budget: float | None  # the SLO's error budget left, as ``ErrorBudget.remaining``
    idle_held: bool  # idle within ``idle_hold_s``: the window neither ages nor lets a level go
    prefill_load: float = field(init=False)  # in replicas, this interval alone
    prefill_cap: float = field(init=False)
    smooth_prefill: float = field(init=False)  # averaged over the last start-up
    decode_load: float = field(init=False)  # the decoded tokens' when a stalled batch is apart
    stalled_need: float | None = field(init=False)  # the sequences piled up behind stalled batches
    own_decode_load: float = field(init=False)  # at each replica's own swing, as a trend is projected
    counts: dict[str, int] = field(init=False)  # what the averaged load needs, as the window takes it
    whys: dict[str, str] = field(init=False)  # the sizer's account of each pool's load
    drain_s: dict[str, float] = field(init=False)  # how long a replica let go takes to drain, per pool


@dataclass
class _Needs:
    """Per pool, what ``SLAPlanner.decide``'s steps so far ask: the count to grow to (``up``), to
    shrink to (``down``), and why (each step appends its clauses)."""

    up: dict[str, int]
    down: dict[str, int]
    why: dict[str, str]

    def grow(self, pool: str, count: int, clause: str, hold: bool = False) -> None:
        """Raises ``pool``'s need to grow to ``count`` when that is more, and says why (``clause``);
        ``hold``: nor may the pool shrink below ``count`` (a rise met ahead, while it rises)."""
        if count > self.up[pool]:
            self.up[pool] = count
            if hold:
                self.down[pool] = max(count, self.down[pool])
            self.why[pool] += f"; {clause}"


class SLAPlanner:
    """Decides pool targets from observations; deterministic, no I/O, no clock of its own.

    It keeps state between calls (the load history, correction factors, when each pool last
    changed), so call ``decide`` once per interval, in order, with the pools as they are now.
    """

    def __init__(self, config: PlannerConfig, perf_model: PerfModel) -> None:
        self.config = config
        self.perf_model = perf_model
        self.predictor = LoadPredictor(config.predictor_alpha, config.predictor_beta, 1 + config.startup_s / config.interval_s)
        self.sizer = ReplicaSizer(config, perf_model)  # counts for a load, and the corrections it learns
        self.window = LoadWindow(config)  # the counts' quantile window and the levels it lets go
        self._last_change_s = {pool: -math.inf for pool in POOLS}
        # Per pool, the times of its changes of direction within the last hour, and its last change's direction.
        self._turns: dict[str, deque[float]] = {pool: deque() for pool in POOLS}
        self._last_up: dict[str, bool | None] = {pool: None for pool in POOLS}
        self._flap_held: set[str] = set()  # this interval's pools the flap limit held
        self._recent_down: dict[str, deque[tuple[float, int]]] = {pool: deque() for pool in POOLS}
        # The window's own clock: the seconds observed that age it. An idle interval (no request at
        # all) does not, until the idle stretch has lasted ``idle_hold_s``.
        self._aged_s = 0.0
        self._idle_s = 0.0
        intervals_per_start_up = self.window.intervals_per_start_up
        self._loads: deque[tuple[float, float]] = deque(maxlen=intervals_per_start_up)
        self._itl_over_intervals = 0  # consecutive intervals whose ITL p90 was over the SLO
        num_start_ups = self.window.derived_start_ups if config.rise_start_ups is None else config.rise_start_ups
        self.trend = LoadTrend(intervals_per_start_up, num_start_ups, config.startup_s, config.interval_s)
        self._rise_ahead = LoadTrend(  # below the deployment
            intervals_per_start_up, 1, config.startup_s, config.interval_s, geometric=True, latest=config.rise_ahead_at_latest_growth
        )
        self._before_rise: dict[str, int] = {}
        # A trend's projection beyond what the window needs is a bet: paid from the replica-seconds the
        # pools have spent below the deployment the planner was turned on over (their first targets).
        self._deployed: dict[str, int] = {}
        self._saved_s = 0.0
        self._paid_above: set[str] = set()  # pools above the deployment on savings, paying each interval
        self._recent: deque[dict[str, int]] = deque(maxlen=self.window.within_needed)  # the last two start-ups' counts
        self.error_budget = ErrorBudget(config)  # what may still miss an SLO before growth above the deployment
        # The seconds a sequence ran (running over request rate, Little's law) in the window's last intervals with requests.
        self._run_times: deque[float] = deque(maxlen=max(1, round(self.window.window_s / config.interval_s)))
        self._last_running: int | None = None
        self._deployment_needed = {pool: False for pool in POOLS}  # an interval's load has needed the deployment's count

    @property
    def corrections(self) -> dict[str, float]:
        """Observed over predicted latency per pool (clamped, smoothed): the sizer's dict itself, not a copy."""
        return self.sizer.corrections

    def decide(self, observation: Observation, pools: Mapping[str, PoolReplicas]) -> Decision:
        """Targets for every pool in ``POOLS`` (``pools`` must hold them all).

        Each step below adjusts, per pool, the need to grow to, the need to shrink to and why
        (``_Needs``), as the steps before it left them: the window's quantile, cut above the deployment
        and with room below it; the rules beyond the window (trends, rises and lengthening answers met
        ahead); the backlogs; aggregation; the rules above the deployment (bursts ridden out, the KV
        rule); then settling turns the needs into targets. The steps also keep the planner's state (the
        window, the trends, the savings, the levels), each reading what those before it left, so their
        order is the decision's."""
        interval = self._observe(observation, pools)
        self._flap_held.clear()
        # This interval's load, as counts, joins the window; the pools are sized for the window's quantile.
        self._size_load(interval)
        released = self._add_to_window(interval)
        base = self.window.quantiles()
        cut = self._cut_above_deployment(base)
        windowed = {pool: base[pool] for pool in POOLS}  # the window's quantile, before the room below
        room = self._keep_room_for_rises(base, interval.counts)
        kept = self._keep_long_levels(base)
        needs = self._window_needs(interval, base, released, windowed, cut, room, kept)
        # Beyond the window: trends bet on, and rises and lengthening answers below the deployment met ahead.
        rising, unfunded = self._bet_on_trends(interval, needs)
        self._meet_rises_ahead(interval, needs)
        self._meet_lengthening_answers(interval, needs)
        # Backlogs: what is over capacity now, which the window (of averaged loads) sees too late.
        prefill_behind = self._clear_prefill_backlog(interval, needs)
        self._grow_for_itl_over_slo(interval, needs)
        self._grow_for_prompts_behind_backlog(interval, needs, prefill_behind)
        self._grow_for_stalled_batch(interval, needs)
        self._aggregate(interval, needs, base)
        # Above the deployment, a burst is ridden out as a static split would ride it out.
        held = self._ride_out_bursts(interval, needs)
        self._grow_for_full_kv(interval, needs, held)
        on_savings = self._paid_above | set(self._before_rise)  # as they stand before settling ends a bet
        targets, reasons, infeasible = self._settle_pools(interval, needs, rising, held)
        self._charge_drains(interval, targets, on_savings)
        return Decision(
            observation.time_s, targets, dict(needs.up), interval.forecast, dict(self.corrections), reasons, tuple(infeasible),
            interval.infeasible_requests, tuple(released), tuple(unfunded), tuple(sorted(held)), room, self._saved_s, interval.budget,
            tuple(pool for pool in POOLS if self._holds_deployment(pool)), {pool: level[0] for pool, level in kept.items()},
            {pool: self._turns_within_hour(pool, observation.time_s) for pool in POOLS}, tuple(sorted(self._flap_held)),
        )

    def _observe(self, obs: Observation, pools: Mapping[str, PoolReplicas]) -> _Interval:
        """Takes the interval in: the deployment (the pools' targets at the first decision), the
        window's own clock (an idle stretch within ``idle_hold_s`` does not age it), the predictor,
        the prompts' statistics, the SLO's error budget and the corrections. Returns the interval,
        its load not yet sized (``_size_load``)."""
        config = self.config
        for pool in POOLS:  # the deployment the planner was turned on over: each pool's target at its first decision
            self._deployed.setdefault(pool, pools[pool].target)
        self._idle_s = 0.0 if obs.num_requests else self._idle_s + obs.duration_s
        idle_held = 0 < self._idle_s <= config.idle_hold_s
        if not idle_held:
            self._aged_s += obs.duration_s
        # Each request's first token comes out of its prefill: the decode pool makes the rest.
        decoded = max(0, obs.num_output_tokens - obs.num_requests)
        observed = LoadForecast(obs.num_requests / obs.duration_s, obs.num_prompt_tokens / obs.duration_s, decoded / obs.duration_s)
        self.predictor.observe(observed.request_rate, observed.prompt_tokens_per_s, observed.output_tokens_per_s)
        forecast = self.predictor.forecast()
        infeasible_requests = self.sizer.measure_prompts(obs)
        # A prompt no replica prefills in time is counted apart, not spent.
        misses = None if obs.slo_misses is None else max(0, obs.slo_misses - infeasible_requests)
        self.error_budget.observe(obs.time_s, obs.duration_s, obs.num_requests, misses)
        budget = self.error_budget.remaining()
        self.sizer.correct(obs, pools, observed.output_tokens_per_s)
        return _Interval(obs, pools, observed, forecast, infeasible_requests, budget, idle_held)

    def _size_load(self, interval: _Interval) -> None:
        """Sizes the interval's load per pool (the sizer's loads and why), averages it over the last
        start-up (a shorter burst counts at its share) and sets the counts that average needs."""
        obs, observed = interval.obs, interval.observed
        prefill_load, prefill_cap, prefill_why = self.sizer.prefill_load(observed)
        decode_load, decode_why = self.sizer.decode_load(observed, obs.decode_running)
        # Sequences in batches that stall while their replicas prefill a queue of their own prompts
        # (the prefill pool empty, or behind) have piled up behind the stall: the pool grows for
        # them now, but the window, which remembers load for half an hour, takes the tokens decoded.
        stalled_need = None
        if obs.decode_running and obs.decode_queued_prefill_tokens:
            tokens_load, _ = self.sizer.decode_load(observed)
            if tokens_load < decode_load:
                stalled_need, decode_load = decode_load, tokens_load
        self._loads.append((prefill_load, decode_load))
        smooth_prefill = sum(p for p, _ in self._loads) / len(self._loads)
        smooth_decode = sum(d for _, d in self._loads) / len(self._loads)
        interval.counts = self.sizer.interval_counts(smooth_prefill, prefill_cap, smooth_decode, observed, obs.decode_running)
        interval.prefill_load, interval.prefill_cap, interval.smooth_prefill = prefill_load, prefill_cap, smooth_prefill
        interval.decode_load, interval.stalled_need = decode_load, stalled_need
        interval.whys = {"prefill": prefill_why, "decode": decode_why}
        interval.drain_s = self._drain_s(obs, interval.pools)
        # A pool growing into a rise is not one balanced batch (its sequences stay where they
        # joined while new replicas start empty), so a trend is projected at each replica's own swing.
        interval.own_decode_load, _ = self.sizer.decode_load(observed, None if stalled_need is not None else obs.decode_running, pooled=False)

    def _add_to_window(self, interval: _Interval) -> dict[str, str]:
        """Adds the interval's counts to the window and to the last two start-ups' counts, and lets go
        of the levels that are over. Returns a clause per pool let go."""
        obs, counts = interval.obs, interval.counts
        self.window.add(obs.time_s, self._aged_s, counts, obs.num_requests)
        released = {} if interval.idle_held else self.window.release_levels(obs.time_s, counts)  # nor is it the load back within a level
        for pool in released:  # a level let go was a trend's rise too: what the pool had before it is forgotten
            self._before_rise.pop(pool, None)
        self._recent.append(counts)
        for pool in POOLS:
            self._deployment_needed[pool] = self._deployment_needed[pool] or counts[pool] >= self._deployed[pool]
        return released

    def _cut_above_deployment(self, base: dict[str, int]) -> dict[str, int]:
        """Lowers the window's needs (``base``, to grow and to shrink) above the deployment to what the
        last two start-ups needed, at least the deployment (``burst_memory_above_deployment`` off).
        Returns the deployment of each pool cut."""
        # Above the deployment (the pools' first targets: what the SRE chose for this traffic), the
        # window's memory of a burst is a guess that it recurs: a pool holds there only what the
        # last two start-ups needed, and goes back to the deployment once a burst is over.
        cut = {}
        if not self.config.burst_memory_above_deployment:
            for pool in POOLS:
                deployed = self._deployed[pool]
                for key in (pool, f"{pool}_down"):
                    if base[key] > deployed:
                        recent_most = max(min(base[key], max(c[key] for c in self._recent)), deployed)
                        if recent_most < base[key]:
                            cut[pool], base[key] = deployed, recent_most
        return cut

    def _keep_room_for_rises(self, base: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
        """Raises the window's needs (``base``) below the deployment to the count the load needs now
        plus the rise the window saw within a start-up and an interval, at most the deployment
        (``rise_room_below_deployment``). Returns the rise kept per pool raised."""
        # Below the deployment, room for the rises the load itself has shown within a reaction.
        room = {}
        if self.config.rise_room_below_deployment:
            for pool, rise in self.window.rises().items():
                roomed = min(self._deployed[pool], counts[pool] + rise)
                if roomed > base[pool]:
                    room[pool] = rise
                    base[pool], base[f"{pool}_down"] = roomed, max(roomed, base[f"{pool}_down"])
        return room

    def _keep_long_levels(self, base: dict[str, int]) -> dict[str, tuple[int, float, float]]:
        """Raises the window's needs to shrink to (``base``) below the deployment to the long levels
        the window would let go before they have been over as long as they held, at most the
        deployment (``level_memory_lengths``). Returns, per pool raised, the level as
        ``LoadWindow.long_levels`` gives it."""
        kept = {}
        for pool, level in self.window.long_levels().items():  # none while off
            key, deployed = f"{pool}_down", self._deployed[pool]
            floor = min(level[0], deployed)
            if floor > base[key]:
                base[key], kept[pool] = floor, (floor, *level[1:])
        return kept

    def _window_needs(
        self,
        interval: _Interval,
        base: dict[str, int],
        released: dict[str, str],
        windowed: dict[str, int],
        cut: dict[str, int],
        room: dict[str, int],
        kept: dict[str, tuple[int, float, float]],
    ) -> _Needs:
        """The needs the window gives (``base``: its quantile, cut above the deployment and with room
        below it) and why: the sizer's account of the load, then the level let go, the window's
        quantile when it needs more than the load now (``windowed``), the cut, the room, the long
        levels kept and an idle stretch the window is held through (the prefill pool's quantile
        comes before the cut, the decode pool's last)."""
        counts = interval.counts
        needs = _Needs({pool: base[pool] for pool in POOLS}, {pool: base[f"{pool}_down"] for pool in POOLS}, dict(interval.whys))
        for pool in POOLS:
            if pool in released:
                needs.why[pool] += f"; {released[pool]}"
        if windowed["prefill"] > counts["prefill"]:
            needs.why["prefill"] += f"; the window's {self.window.quantile:g} quantile needs {windowed['prefill']}"
        for pool, deployed in cut.items():
            needs.why[pool] += f"; above the deployment's {deployed}, only what the last two start-ups needed"
        for pool, rise in room.items():
            if rise:
                clause = f"; {base[pool]} for the {counts[pool]} the load needs now and a rise of {rise} the window saw within a start-up and an interval"
            else:  # the load now needs more than the window's quantile, which leaves this interval out
                clause = f"; {base[pool]} for the load now, over what the window's {self.window.quantile:g} quantile needs"
            needs.why[pool] += f"{clause} (the deployment's {self._deployed[pool]} at most)"
        for pool, (count, held_s, ago_s) in kept.items():
            needs.why[pool] += f"; {count} kept for the level of {held_s / 60:.0f} minutes that needed it until {ago_s / 60:.0f} minutes ago (kept {self.config.level_memory_lengths:g} times as long after it as it held, {self.window.level_memory_max_s / 60:g} minutes at most)"
        if interval.idle_held:
            idle = f"; no request for {self._idle_s:.0f} s: the window keeps the traffic before it for up to {self.config.idle_hold_s:g} s idle"
            for pool in POOLS:
                needs.why[pool] += idle
        if windowed["decode"] > counts["decode"]:
            needs.why["decode"] += f"; the window's {self.window.quantile:g} quantile needs {windowed['decode']}"
        return needs

    def _bet_on_trends(self, interval: _Interval, needs: _Needs) -> tuple[dict[str, int], list[str]]:
        """Grows each pool whose load is a trend to the load projected to when replicas asked for now
        are warm, a bet paid from the replica-seconds saved below the deployment unless the load
        already needs more than it (``trend_bets_from_savings``); the pool does not shrink below the
        projection while the load rises. Returns what each pool grown needed before (``rising``) and
        the pools whose trend was not bet on (``unfunded``)."""
        # Beyond the window: a load that has risen over each of the last k start-ups is a trend, and the
        # pool grows now to the load projected to when replicas asked for now are warm. That is a bet
        # unless the load already needs more than the deployment had: it is paid from savings.
        config, pools, counts = self.config, interval.pools, interval.counts
        self.trend.observe((interval.prefill_load, interval.own_decode_load))
        self._account(interval.obs, pools)
        rising, unfunded = {}, []
        for pool, projected in self.trend.rises().items():
            count = min(self.sizer.count(pool, projected, interval.prefill_cap), config.max_prefill if pool == "prefill" else config.max_decode)
            if count <= needs.up[pool]:
                continue
            clause = f"rising over each of the last {self.trend.num_start_ups} start-ups, {count} for the load a start-up and half an interval ahead"
            cost_s = (count - max(needs.up[pool], pools[pool].target)) * (config.startup_s + config.interval_s)
            if config.trend_bets_from_savings and counts[pool] <= self._deployed[pool] and self._saved_s < cost_s:
                unfunded.append(pool)
                clause = f"{clause}, not bet on: {self._saved_s:.0f} replica-seconds saved below the deployment's {self._deployed[pool]}, {cost_s:.0f} needed"
            else:
                rising[pool], needs.up[pool] = needs.up[pool], count
            needs.why[pool] += f"; {clause}"
        for pool in rising:  # nor does a pool shrink below a trend's projection while the load rises
            needs.down[pool] = max(needs.down[pool], needs.up[pool])
        return rising, unfunded

    def _meet_rises_ahead(self, interval: _Interval, needs: _Needs) -> None:
        """Grows each pool whose load rose over the last start-up to that load grown on at its rate to
        when replicas asked for now are warm, at most the deployment (``rise_ahead_below_deployment``),
        and does not let it shrink below that while the load rises."""
        # Below the deployment a rise over the last start-up is met ahead at once: up to the deployment a
        # rise that does not go on costs nothing a static split would not spend.
        self._rise_ahead.observe((interval.prefill_load, interval.own_decode_load))
        if self.config.rise_ahead_below_deployment:
            for pool, projected in self._rise_ahead.rises().items():
                count = min(self.sizer.count(pool, projected, interval.prefill_cap), self._deployed[pool])
                growth = " at the growth of the last two intervals, which rose each" if pool in self._rise_ahead.at_latest else ""
                clause = f"rising over the last start-up, {count} for the load a start-up and half an interval ahead{growth} (the deployment's {self._deployed[pool]} at most)"
                needs.grow(pool, count, clause, hold=True)  # nor does the pool shrink below it while it rises

    def _meet_lengthening_answers(self, interval: _Interval, needs: _Needs) -> None:
        """Grows the decode pool ahead for answers that lengthen (``lengthening_ahead_below_deployment``):
        a running count over what the request rate keeps at the window's longest run time (Little's
        law), and grown since the interval before, each past its Poisson swing, grows on at its last
        interval's growth, at most the deployment."""
        config, obs, rate = self.config, interval.obs, interval.observed.request_rate
        running, last = obs.decode_running, self._last_running
        self._last_running = running
        if running is None or not rate:
            return
        run_s, longest_s = running / rate, max(self._run_times, default=math.inf)
        self._run_times.append(run_s)
        # More running than the rate keeps at the window's longest run time, and a growth, each past its Poisson swing.
        growth, kept = running - (last or 0), rate * longest_s
        z = self.sizer.z
        if not config.lengthening_ahead_below_deployment or last is None or running <= kept + z * math.sqrt(kept) or growth <= z * math.sqrt(max(1, last)):
            return
        ahead = running + growth * (config.startup_s + config.interval_s / 2) / config.interval_s
        load, _ = self.sizer.decode_load(LoadForecast(0.0, 0.0, 0.0), math.ceil(ahead), pooled=False)
        count = min(self.sizer.decode_count(load), self._deployed["decode"])
        clause = (
            f"answers lengthening ({running} sequences running, {growth} more, {run_s:.1f} s each at the request rate,"
            f" longer than the window's {longest_s:.1f}), {count} for {ahead:.0f} running a start-up and half an interval ahead"
            f" (the deployment's {self._deployed['decode']} at most)"
        )
        needs.grow("decode", count, clause, hold=True)

    def _clear_prefill_backlog(self, interval: _Interval, needs: _Needs) -> bool:
        """Grows the prefill pool to clear a backlog that already makes a new prompt wait past the
        SLO. Returns whether the prefill pool is behind so."""
        # Beyond the window: a backlog that already makes a new prompt wait past the SLO means the
        # load is over capacity now; the pool grows to this interval's load plus the replicas that
        # clear the backlog within a start-up and an interval.
        obs, config = interval.obs, self.config
        backlog_s = obs.queued_prefill_tokens * self.sizer.seconds_per_token
        slack_s = config.ttft_slo_s - self.sizer.corrected_prefill_s()
        prefill_behind = backlog_s > slack_s * max(1, interval.pools["prefill"].ready)
        if needs.up["prefill"] > 0 and prefill_behind:
            clearing_load = max(interval.prefill_load, interval.smooth_prefill) + backlog_s / (config.startup_s + config.interval_s)
            needs.grow("prefill", self.sizer.prefill_count(clearing_load, interval.prefill_cap), f"{obs.queued_prefill_tokens} tokens queued")
        return prefill_behind

    def _grow_for_itl_over_slo(self, interval: _Interval, needs: _Needs) -> None:
        """Grows the decode pool to this interval's load once its ITL has been over the SLO for a start-up."""
        # The decode pool's backlog is its batch: an ITL over the SLO in each interval of the last
        # start-up means it is over capacity for longer than a replica takes to start, and it grows
        # to this interval's load rather than the start-up's average. A shorter spell is a burst the
        # pool rides out: replicas asked for on it would be warm after it.
        obs = interval.obs
        itl_over = obs.itl_s_p90 is not None and obs.itl_s_p90 > self.config.itl_slo_s
        self._itl_over_intervals = self._itl_over_intervals + 1 if itl_over else 0
        if self._itl_over_intervals >= self._loads.maxlen:
            now_need = self.sizer.decode_count(interval.decode_load + (interval.prefill_load if needs.up["prefill"] == 0 else 0.0))
            needs.grow("decode", now_need, f"the ITL p90 {obs.itl_s_p90:.3f} s is over the SLO, {self._itl_over_intervals} intervals running")

    def _grow_for_prompts_behind_backlog(self, interval: _Interval, needs: _Needs, prefill_behind: bool) -> None:
        """Grows the decode pool for the running sequences and the prompts queued behind a prefill backlog."""
        # Prompts queued behind that backlog are sequences on their way to the decode pool, which sees
        # them only once prefilled: it grows now for them and the running ones, so that its replicas
        # are warm when the backlog clears (prompts queued on decode replicas are the stalled batch's).
        obs = interval.obs
        coming = obs.queued_prefill_tokens - obs.decode_queued_prefill_tokens
        if prefill_behind and obs.decode_running is not None and obs.num_prompt_tokens > 0 and coming > 0:
            coming_requests = round(coming * obs.num_requests / obs.num_prompt_tokens)
            ahead_load, _ = self.sizer.decode_load(LoadForecast(0.0, 0.0, 0.0), obs.decode_running + coming_requests)
            clause = f"{obs.decode_running} sequences running and {coming_requests} prompts queued for prefill behind its backlog"
            needs.grow("decode", self.sizer.decode_count(ahead_load), clause)

    def _grow_for_stalled_batch(self, interval: _Interval, needs: _Needs) -> None:
        """Grows the decode pool for the sequences piled up behind batches stalled by their replicas'
        own prefills (``_size_load`` left them out of the window)."""
        if interval.stalled_need is not None:
            needs.grow("decode", self.sizer.decode_count(interval.stalled_need), f"{interval.obs.decode_running} sequences in a stalled batch")

    def _aggregate(self, interval: _Interval, needs: _Needs, base: dict[str, int]) -> None:
        """Takes the prefill pool to zero where the decode replicas, each prefilling its share, serve
        the load with fewer replicas than two pools (``aggregate_when_cheaper``), or keeps it there
        while they still do; ``base`` is the window's needs, with ``alone`` and ``alone_down``."""
        config, pools = self.config, interval.pools
        prefill_need, decode_need = needs.up["prefill"], needs.up["decode"]
        aggregated = pools["prefill"].target == 0
        if (config.aggregate_when_cheaper or aggregated) and config.min_prefill == 0 and prefill_need > 0:
            # Conditional disaggregation: the decode replicas alone, each prefilling its share of
            # the prompts, may serve the load with fewer replicas than two pools. An aggregated
            # cluster stays so while its decode replicas suffice (a prefill pool added beside them
            # would be a replica more), and a load that would need more of them brings the prefill
            # pool back instead (a growing prompt load is served best apart from the decode batches).
            # Entering, with aggregate_when_cheaper, needs the scale-down margin's headroom.
            alone, alone_down = base["alone"], base["alone_down"]
            # What the rules beyond the window ask of the decode pool, added to the replicas that also
            # prefill, up to what those rules ask or the deployment (the rules' own bounds).
            beyond = decode_need - base["decode"]
            decode_rise = config.aggregated_keeps_rises and beyond > 0
            if decode_rise:
                alone = max(alone, min(alone + beyond, max(decode_need, self._deployed["decode"])))
                alone_down = max(alone_down, alone)
            # A rise of the decode load grows an aggregated cluster's replicas while that is cheaper than two pools.
            staying = alone <= prefill_need + decode_need if decode_rise else alone <= min(prefill_need + decode_need, pools["decode"].target)
            if (config.aggregate_when_cheaper and alone_down < prefill_need + decode_need) or (aggregated and staying):
                needs.up["decode"], needs.down["decode"] = alone, alone_down
                if aggregated or (pools["decode"].ready >= max(alone, config.min_decode) and not pools["decode"].starting):
                    needs.up["prefill"] = needs.down["prefill"] = 0
                    needs.why["prefill"] += f": the decode replicas prefill it themselves, {alone} of them instead of two pools"
                    added = alone - base["alone"]
                    grown = f", {added} more for what the decode load alone asks beyond its window ({needs.why['decode']})" if added > 0 else ""
                    needs.why["decode"] = f"{interval.observed.output_tokens_per_s:.0f} output tokens/s and every prompt, prefilled on the decode replicas{grown}"
                else:  # the prefill pool serves until every decode replica that takes its load over is ready
                    needs.up["prefill"] = needs.down["prefill"] = pools["prefill"].target
                    needs.why["prefill"] += f": kept until {alone} decode replicas are ready to prefill it themselves"

    def _ride_out_bursts(self, interval: _Interval, needs: _Needs) -> set[str]:
        """With ``burst_growth_above_deployment`` off, holds each pool at the deployment (or above it,
        where it already is) unless its load has needed more than the deployment in each interval of
        the last two start-ups and still does in this one alone (not averaged over a start-up: a
        burst's averaged tail is over), a shift that replicas asked for now still catch, and the SLO's
        error budget (``ErrorBudget.remaining``) is spent; or unless the replica-seconds saved below
        the deployment pay for the replicas it adds, for a start-up and an interval (and, with
        ``savings_count_drains``, their drain). With ``savings_pay_while_above`` those replicas are
        then charged each interval they are kept (``_account``), and a pool goes back to the
        deployment once the savings no longer pay an interval of them and their drain. Returns the
        pools held."""
        config, pools, budget = self.config, interval.pools, interval.budget
        held: set[str] = set()
        if config.burst_growth_above_deployment:
            return held
        obs, drain_s = interval.obs, interval.drain_s
        now = self.sizer.interval_counts(interval.prefill_load, interval.prefill_cap, interval.decode_load, interval.observed, obs.decode_running)  # this interval alone, not averaged
        for pool in POOLS:
            deployed, current = self._deployed[pool], pools[pool].target
            floor = max(deployed, current)
            recent, unspent = self._recent, ""
            shift = len(recent) == recent.maxlen and now[pool] > deployed and all(counts[pool] > deployed for counts in recent)
            if shift and (budget is None or budget <= 0):
                self._paid_above.discard(pool)  # a shift: grows as asked, and stays on its own account
                continue
            if shift:
                unspent = f"; a shift, but{self.error_budget.unspent_clause(budget)}"  # the deployment serves it within the SLO, as a static split of it would
            if pool in self._paid_above and current > deployed and self._saved_s < (current - deployed) * (config.interval_s + drain_s[pool]):
                # The savings that paid for the replicas above the deployment are spent (their drain kept back).
                needs.up[pool], needs.down[pool] = deployed, min(needs.down[pool], deployed)
                needs.why[pool] += (
                    f"; back to the deployment's {deployed}: the {self._saved_s:.0f} replica-seconds saved below it no longer pay for {current - deployed} above it"
                    f"{f' and their {drain_s[pool]:.0f} s drain' if drain_s[pool] else ''}{unspent}"
                )
                held.add(pool)
                continue
            if needs.up[pool] <= floor:
                continue
            high = config.max_prefill if pool == "prefill" else config.max_decode
            if floor >= high:
                continue  # nothing to add: settling holds it at max, and says so
            cost_s = (min(needs.up[pool], high) - floor) * (config.startup_s + config.interval_s + drain_s[pool])  # max is all it can add
            if self._saved_s >= cost_s:
                needs.why[pool] += f"; above the deployment's {deployed}, {cost_s:.0f} of the {self._saved_s:.0f} replica-seconds saved below it paid"
                if config.savings_pay_while_above:
                    self._paid_above.add(pool)  # paid for as long as they are kept, by _account
                else:
                    self._saved_s -= cost_s
                continue
            needs.why[pool] += (
                f"; held at {floor} for {needs.up[pool]}: above the deployment's {deployed} a pool grows for load"
                f" that needed more over the last two start-ups, or on savings ({self._saved_s:.0f} replica-seconds, {cost_s:.0f} needed){unspent}"
            )
            needs.up[pool] = floor
            held.add(pool)
        return held

    def _drain_s(self, obs: Observation, pools: Mapping[str, PoolReplicas]) -> dict[str, float]:
        """Per pool, how long a replica let go takes to drain (``savings_count_drains``; else 0). A
        decode replica's lasts until the longest of its m running sequences ends: a sequence decodes
        for W, by Little's law the sequences running over the rate they arrive at, and the longest of
        m memoryless remainders lasts W times the m-th harmonic number (at most a window's span; 0 with
        no sequence running or none arriving). A prefill replica's is its share of a backlog, seconds: 0."""
        decode = 0.0
        running, replicas = obs.decode_running, pools["decode"].target
        if self.config.savings_count_drains and running and obs.num_requests and replicas:
            per_replica = math.ceil(running / replicas)
            longest = sum(1.0 / i for i in range(1, per_replica + 1))
            decode = min(running * obs.duration_s / obs.num_requests * longest, self.window.window_s)
        return {"prefill": 0.0, "decode": decode}

    def _charge_drains(self, interval: _Interval, targets: Mapping[str, int], on_savings: set[str]) -> None:
        """Charges the replica-seconds saved for the drains of the replicas this decision lets go:
        they are paid for until they have drained. Above the deployment only the pools there on
        savings (``on_savings``: paid from them, or a trend bet) are charged; a shift's replicas grew
        on the SLO's account."""
        for pool in POOLS:
            current, deployed = interval.pools[pool].target, self._deployed[pool]
            top = current if pool in on_savings else min(current, deployed)
            self._saved_s -= max(0, top - targets[pool]) * interval.drain_s[pool]

    def _grow_for_full_kv(self, interval: _Interval, needs: _Needs, held: set[str]) -> None:
        """Grows the decode pool by a replica while its KV use is over ``kv_usage_high``, unless the KV
        is filled by prompts no replica prefills in time, or the pool would grow above the deployment
        with the error budget unspent (then it is held: added to ``held``). With ``kv_holds_decode``
        the pool does not shrink below the replicas that hold the KV in use under ``kv_usage_high``
        (nor is it held above the deployment for it where the rule would not grow there)."""
        obs, config, decode = interval.obs, self.config, interval.pools["decode"]
        infeasible = self.sizer.only_infeasible(interval.observed)  # the KV is theirs: a replica more serves nobody in time
        # Above the deployment a full KV pool queues requests as a static split of it would, and their
        # misses are what the error budget counts: neither rule takes decode past it while it is unspent.
        budget_unspent = not config.burst_growth_above_deployment and (interval.budget or 0) > 0
        if config.kv_holds_decode and obs.kv_usage is not None and decode.ready and not infeasible:
            # The KV in use swings as the running count does: z at the attainment target times its root.
            swing = 1 + self.sizer.z / math.sqrt(obs.decode_running) if obs.decode_running else 1.0
            holding = min(decode.ready, math.ceil(obs.kv_usage * swing * decode.ready / config.kv_usage_high - 1e-9))
            if budget_unspent:
                holding = min(holding, max(self._deployed["decode"], needs.down["decode"]))
            if holding > needs.down["decode"]:
                needs.down["decode"] = holding
                needs.why["decode"] += (
                    f"; not below {holding}: the KV in use ({obs.kv_usage:.2f} of {decode.ready} replicas', {swing - 1:.0%} more"
                    f" at its swing) would fill fewer past {config.kv_usage_high:g}"
                )
        if obs.kv_usage is not None and obs.kv_usage > config.kv_usage_high and decode.ready + 1 > needs.up["decode"]:
            if infeasible:
                needs.why["decode"] += f"; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}, filled by prompts no replica prefills within the TTFT SLO: not grown for"
            elif budget_unspent and decode.ready + 1 > max(self._deployed["decode"], decode.target):
                needs.why["decode"] += (
                    f"; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}, but above the deployment's {self._deployed['decode']}"
                    f"{self.error_budget.unspent_clause(interval.budget)}"
                )
                held.add("decode")
            else:
                needs.up["decode"] = decode.ready + 1
                needs.why["decode"] += f"; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}"

    def _settle_pools(
        self, interval: _Interval, needs: _Needs, rising: dict[str, int], held: set[str]
    ) -> tuple[dict[str, int], dict[str, str], list[str]]:
        """(targets, reasons, infeasible pools): each pool settled (``_settle``), then taken back once a
        trend it grew on falls, and its level tracked for the window to let go."""
        obs, pools, config = interval.obs, interval.pools, self.config
        targets, reasons, infeasible = {}, {}, []
        missing = {"prefill": (obs.ttft_s_p90 or 0.0) > config.ttft_slo_s, "decode": (obs.itl_s_p90 or 0.0) > config.itl_slo_s}
        for pool in POOLS:
            need, why = needs.up[pool], needs.why[pool]
            targets[pool], reasons[pool], flagged = self._settle(pool, need, needs.down[pool], pools[pool], obs.time_s, why, missing[pool])
            if flagged:
                infeasible.append(pool)
            # Replicas grown on a trend go once the load falls: back to what the pool had before the
            # rise or what the window needs now, whichever is more, with no cooldown (they were a bet).
            if pool in rising:
                if targets[pool] > pools[pool].target:
                    self._before_rise.setdefault(pool, pools[pool].target)
            elif pool in self._before_rise and self.trend.falling(pool):
                back = max(need, self._before_rise.pop(pool), config.min_prefill if pool == "prefill" else config.min_decode)
                if back < targets[pool] and self._flap_limited(pool, targets[pool], obs.time_s):
                    reasons[pool] += f"; the rise is over, but {self._turns_within_hour(pool, obs.time_s)} changes of direction in the last hour hold it"
                    self._flap_held.add(pool)
                elif back < targets[pool]:
                    targets[pool], reasons[pool] = back, f"back to {back}: the rise is over ({why})"
                    self._changed(pool, False, obs.time_s)
            self.window.track_level(pool, pools[pool].target, targets[pool], interval.counts[f"{pool}_down"], pool in held, obs.time_s)
        if interval.infeasible_requests:
            reasons["prefill"] += f" ({interval.infeasible_requests} requests had prompts no replica prefills within the TTFT SLO)"
        return targets, reasons, infeasible

    def _account(self, obs: Observation, pools: Mapping[str, PoolReplicas]) -> None:
        """Adds the interval just observed to the replica-seconds saved: each pool's count below the
        deployment (its target at the first decision), less the replicas a trend bet holds above what
        the pool had before the rise or, for a pool above the deployment on savings, those above the
        deployment: the larger of the two, since each counts the same replicas from its own start."""
        for pool in POOLS:
            deployed, target = self._deployed[pool], pools[pool].target
            self._saved_s += max(0, deployed - target) * obs.duration_s
            bet = max(0, target - self._before_rise[pool]) if pool in self._before_rise else 0
            if pool in self._paid_above and target <= deployed:
                self._paid_above.discard(pool)
            above = target - deployed if pool in self._paid_above else 0
            self._saved_s -= max(bet, above) * obs.duration_s

    def _stabilised(self, pool: str, need_down: int, now_s: float) -> int:
        """The most ``need_down`` asked for over the last ``scale_down_window_s`` (this one included)."""
        recent = self._recent_down[pool]
        recent.append((now_s, need_down))
        while len(recent) > 1 and recent[0][0] <= now_s - self.config.scale_down_window_s:
            recent.popleft()
        return max(n for _, n in recent)

    def _holds_deployment(self, pool: str) -> bool:
        """Whether ``hold_deployment_until_needed_s`` keeps ``pool`` at its deployment: on, not yet
        needed by any interval's load, and within that many seconds observed (None: no limit)."""
        hold_s = self.config.hold_deployment_until_needed_s
        return hold_s != 0 and not self._deployment_needed[pool] and (hold_s is None or self._aged_s < hold_s)

    def _settle(self, pool: str, need: int, need_down: int, replicas: PoolReplicas, now_s: float, why: str, missing_slo: bool) -> tuple[int, str, bool]:
        """(target, reason, infeasible) for one pool, from what it needs to grow and to shrink."""
        config = self.config
        low, high = (config.min_prefill, config.max_prefill) if pool == "prefill" else (config.min_decode, config.max_decode)
        current = replicas.target
        target, flagged = current, False
        this_interval, need_down = need_down, self._stabilised(pool, need_down, now_s)
        warming = self._aged_s < self.window.warmup_s and need_down < current
        deployed = self._deployed[pool]
        if warming and not config.burst_memory_above_deployment and current > deployed:
            need_down, warming = max(need_down, deployed), False  # the warm-up holds the deployment, not growth above it
        if need > high:
            target, flagged = high, True
            reason = f"no count up to {high} meets the SLO for {why}: holding at max {high}"
        elif need > current:
            target, reason = need, f"up to {need} for {why}"
            # Below the deployment a rise is met ahead of its step: it mostly goes on for the start-up
            # its replicas take, and up to the deployment they cost nothing a static split would not.
            ahead = min(deployed, current + math.ceil(config.rise_step_below_deployment * (need - current) - 1e-9))
            if ahead > need:
                target, reason = ahead, f"up to {ahead}, {config.rise_step_below_deployment:g} times the step to {need} (the deployment's {deployed} at most), for {why}"
        elif warming:
            reason = f"holding at {current}: {self._aged_s:.0f} s of the {self.window.warmup_s:.0f} s window observed, too few to shrink on"
        elif need_down < current and replicas.starting:
            reason = f"holding at {current}: {replicas.starting} replicas still starting"
        elif need_down < current and missing_slo:
            reason = f"holding at {current}: the SLO was missed last interval"
        elif need_down < current and need_down < deployed and self._holds_deployment(pool):
            floor = min(current, deployed)
            limit = "" if config.hold_deployment_until_needed_s is None else f" of {config.hold_deployment_until_needed_s:g}"
            held = f"no interval's load has needed the deployment's {deployed} yet ({self._aged_s:.0f}{limit} s observed)"
            target, reason = floor, (f"holding at {current}: {held}" if floor == current else f"down to {floor} for {why}; {held}")
        elif need_down < current and self._flap_limited(pool, current, now_s):
            turns = self._turns_within_hour(pool, now_s)
            reason = f"holding at {current}: {turns} changes of direction in the last hour, of the {config.flap_limit_per_hour} it may make"
            self._flap_held.add(pool)
        elif need_down < current and now_s - self._last_change_s[pool] < config.scale_down_cooldown_s and (
            config.burst_memory_above_deployment or need_down < deployed
        ):  # above the deployment (held only for recent load) replicas go without a cooldown
            reason = f"holding at {current}: cooling down since the change at {self._last_change_s[pool]:.0f} s"
        elif need_down < current:
            within = f", the most the last {config.scale_down_window_s:g} s needed," if need_down > this_interval else ""
            target, reason = need_down, f"down to {max(low, need_down)}{within} for {why}"
        elif this_interval < current:  # the window holds what this interval alone would shrink
            reason = f"holding at {current}: needed within the last {config.scale_down_window_s:g} s"
        else:
            reason = f"holding at {current} for {why}"
        target = max(low, min(high, target))
        if target != current:
            self._changed(pool, target > current, now_s)
        return target, reason, flagged

    def _changed(self, pool: str, up: bool, now_s: float) -> None:
        """Records a change of ``pool``'s target at ``now_s`` (for the cooldown and ``flap_limit_per_hour``)."""
        self._last_change_s[pool] = now_s
        if self._last_up[pool] is not None and self._last_up[pool] != up:
            self._turns[pool].append(now_s)
        self._last_up[pool] = up

    def _flap_limited(self, pool: str, current: int, now_s: float) -> bool:
        """Whether ``flap_limit_per_hour`` holds ``pool`` at ``current`` rather than turning it down:
        at or below the deployment, its last change up, and a turn down now would leave no room within
        the hour for the turn up that may have to follow (growing is never held back)."""
        limit = self.config.flap_limit_per_hour
        return bool(limit) and current <= self._deployed[pool] and bool(self._last_up[pool]) and self._turns_within_hour(pool, now_s) + 2 > limit

    def _turns_within_hour(self, pool: str, now_s: float) -> int:
        """How many times ``pool`` changed direction in the hour before ``now_s``."""
        turns = self._turns[pool]
        while turns and turns[0] <= now_s - 3600.0:
            turns.popleft()
        return len(turns)
