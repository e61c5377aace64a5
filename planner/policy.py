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
Below the deployment each pool also keeps room for the load's own rises (``rise_room_below_deployment``):
the count it needs now plus the quantile (as the window's) of how far its count rose from an
interval of the window's span within the start-up and interval after it, at most the deployment;
the quantile leaves a burst out, and replicas up to the deployment cost nothing a static split
would not. A level let go takes its rise with it.
Below the deployment a load that rose over the last start-up is met ahead at once
(``rise_ahead_below_deployment``): the pool grows to the load grown on at that rate to when
replicas asked for now are warm, at most the deployment, and holds that while the load rises.
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
from dataclasses import dataclass
from statistics import NormalDist

from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.observation import Decision, Observation
from planner.perf_model import PerfModel
from planner.predictor import LoadForecast, LoadPredictor
from planner.queueing import erlang_c, pooled_wait_share, wait_tail
from planner.trend import LoadTrend, rise_start_ups


@dataclass
class _Level:
    """A pool grown (or that would have grown, but for the deployment) above ``before`` replicas: when
    the current run of load that count does not carry began (None: between runs), and the intervals
    in a row since whose load it carries."""

    before: int
    run_s: float | None
    within: int = 0
    held: bool = False  # the deployment held the pool at ``before`` (burst_growth_above_deployment off)


class SLAPlanner:
    """Decides pool targets from observations; deterministic, no I/O, no clock of its own.

    It keeps state between calls (the load history, correction factors, when each pool last
    changed), so call ``decide`` once per interval, in order, with the pools as they are now.
    """

    def __init__(self, config: PlannerConfig, perf_model: PerfModel) -> None:
        self.config = config
        self.perf_model = perf_model
        self.predictor = LoadPredictor(config.predictor_alpha, config.predictor_beta, 1 + config.startup_s / config.interval_s)
        self.corrections = {pool: 1.0 for pool in POOLS}
        self._last_change_s = {pool: -math.inf for pool in POOLS}
        self._recent_down: dict[str, deque[tuple[float, int]]] = {pool: deque() for pool in POOLS}
        self._last_ready: dict[str, int] = {}
        self._prompt_tokens = float(perf_model.prefill[0][0])
        self._quantile = config.attainment_target if config.base_quantile is None else config.base_quantile
        derived_s = round(max(4 * config.interval_s, (config.startup_s + config.interval_s) / (1 - self._quantile)), 6)
        self._window_s = config.base_window_s if config.base_window_s is not None else derived_s
        self._warmup_s = min(self._window_s, derived_s)  # no pool shrinks before this much is observed
        # Every interval of the window's span in order: [time, aged, requests, counts]. A level let go
        # leaves its intervals' counts None: the window forgets them (``_remembered``), and no rise
        # within a reaction (a start-up and an interval: from a rise's first interval to the replicas
        # it asks for being warm) spans them.
        self._window: deque[list] = deque()
        self._reaction = max(1, math.ceil((config.startup_s + config.interval_s) / config.interval_s - 1e-9))
        # The window's own clock: the seconds observed that age it. An idle interval (no request at
        # all) does not, until the idle stretch has lasted ``idle_hold_s``.
        self._aged_s = 0.0
        self._idle_s = 0.0
        self._seconds_per_token = perf_model.prefill_s(self._prompt_tokens) / self._prompt_tokens
        self._spread = 1.0
        self._measured = False
        intervals_per_start_up = max(1, math.ceil(config.startup_s / config.interval_s - 1e-9))
        self._loads: deque[tuple[float, float]] = deque(maxlen=intervals_per_start_up)
        self._itl_over_intervals = 0  # consecutive intervals whose ITL p90 was over the SLO
        derived_start_ups = rise_start_ups(max(self._window_s / config.interval_s, 1 / (1 - config.attainment_target)))
        num_start_ups = derived_start_ups if config.rise_start_ups is None else config.rise_start_ups
        self.trend = LoadTrend(intervals_per_start_up, num_start_ups, config.startup_s, config.interval_s)
        self._rise_ahead = LoadTrend(  # below the deployment
            intervals_per_start_up, 1, config.startup_s, config.interval_s, geometric=True, latest=config.rise_ahead_at_latest_growth
        )
        self._before_rise: dict[str, int] = {}
        # A trend's projection beyond what the window needs is a bet: paid from the replica-seconds the
        # pools have spent below the deployment the planner was turned on over (their first targets).
        self._deployed: dict[str, int] = {}
        self._saved_s = 0.0
        # Pools grown above a count, and the intervals in a row whose load that count carries. A run
        # that lasted long enough and is followed by two start-ups within the count is a level, let go.
        self._levels: dict[str, list[_Level]] = {pool: [] for pool in POOLS}  # outermost first
        self._steady = {pool: 0 for pool in POOLS}  # intervals in a row whose load the pool's target carries
        self._within_needed = 2 * intervals_per_start_up
        self._recent: deque[dict[str, int]] = deque(maxlen=self._within_needed)  # the last two start-ups' counts
        self._level_s = config.release_level_after_s
        if self._level_s is None:
            self._level_s = (derived_start_ups + 3) * intervals_per_start_up * config.interval_s
        self._z = NormalDist().inv_cdf(config.attainment_target)
        # The SLO's error budget: (time, requests, misses) of each interval of the budget's window
        # whose observation counted the requests that missed an SLO.
        self._misses: deque[tuple[float, int, int]] = deque()
        self._began_s: float | None = None  # when the first interval observed began
        self._feasible_work = 1.0  # the share of the last interval's prefill seconds that were feasible prompts'

    def decide(self, observation: Observation, pools: Mapping[str, PoolReplicas]) -> Decision:
        """Targets for every pool in ``POOLS`` (``pools`` must hold them all)."""
        obs, config = observation, self.config
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
        infeasible_requests = self._measure_prompts(obs)
        if self._began_s is None:
            self._began_s = obs.time_s - obs.duration_s
        if obs.slo_misses is not None:  # a prompt no replica prefills in time is counted apart, not spent
            self._misses.append((obs.time_s, obs.num_requests, max(0, obs.slo_misses - infeasible_requests)))
        while self._misses and self._misses[0][0] <= obs.time_s - config.error_budget_window_s:
            self._misses.popleft()
        budget = self._error_budget()
        self._correct(obs, pools, observed.output_tokens_per_s)

        # This interval's load, as counts, joins the window; the pools are sized for the window's quantile.
        prefill_load, prefill_cap, prefill_why = self._prefill_load(observed)
        decode_load, decode_why = self._decode_load(observed, obs.decode_running)
        # Sequences in batches that stall while their replicas prefill a queue of their own prompts
        # (the prefill pool empty, or behind) have piled up behind the stall: the pool grows for
        # them now, but the window, which remembers load for half an hour, takes the tokens decoded.
        stalled_need = None
        if obs.decode_running and obs.decode_queued_prefill_tokens:
            tokens_load, _ = self._decode_load(observed)
            if tokens_load < decode_load:
                stalled_need, decode_load = decode_load, tokens_load
        self._loads.append((prefill_load, decode_load))
        smooth_prefill = sum(p for p, _ in self._loads) / len(self._loads)
        smooth_decode = sum(d for _, d in self._loads) / len(self._loads)
        counts = self._interval_counts(smooth_prefill, prefill_cap, smooth_decode, observed, obs.decode_running)
        self._window_add(obs.time_s, counts, obs.num_requests)
        released = {} if idle_held else self._release_levels(obs.time_s, counts)  # nor is it the load back within a level
        self._recent.append(counts)
        base = self._window_quantiles()
        # Above the deployment (the pools' first targets: what the SRE chose for this traffic), the
        # window's memory of a burst is a guess that it recurs: a pool holds there only what the
        # last two start-ups needed, and goes back to the deployment once a burst is over.
        cut = {}
        if not config.burst_memory_above_deployment:
            for pool in POOLS:
                deployed = self._deployed[pool]
                for key in (pool, f"{pool}_down"):
                    if base[key] > deployed:
                        recent_most = max(min(base[key], max(c[key] for c in self._recent)), deployed)
                        if recent_most < base[key]:
                            cut[pool], base[key] = deployed, recent_most
        # Below the deployment, room for the rises the load itself has shown within a reaction.
        windowed, room = {pool: base[pool] for pool in POOLS}, {}
        if config.rise_room_below_deployment:
            for pool, rise in self._rises().items():
                roomed = min(self._deployed[pool], counts[pool] + rise)
                if roomed > base[pool]:
                    room[pool] = rise
                    base[pool], base[f"{pool}_down"] = roomed, max(roomed, base[f"{pool}_down"])
        prefill_need, prefill_need_down, decode_need, decode_need_down = (base[k] for k in ("prefill", "prefill_down", "decode", "decode_down"))
        if "prefill" in released:
            prefill_why = f"{prefill_why}; {released['prefill']}"
        if "decode" in released:
            decode_why = f"{decode_why}; {released['decode']}"
        if windowed["prefill"] > counts["prefill"]:
            prefill_why = f"{prefill_why}; the window's {self._quantile:g} quantile needs {windowed['prefill']}"
        for pool, deployed in cut.items():
            clause = f"; above the deployment's {deployed}, only what the last two start-ups needed"
            prefill_why, decode_why = (prefill_why + clause, decode_why) if pool == "prefill" else (prefill_why, decode_why + clause)
        for pool, rise in room.items():
            if rise:
                clause = f"; {base[pool]} for the {counts[pool]} the load needs now and a rise of {rise} the window saw within a start-up and an interval"
            else:  # the load now needs more than the window's quantile, which leaves this interval out
                clause = f"; {base[pool]} for the load now, over what the window's {self._quantile:g} quantile needs"
            clause = f"{clause} (the deployment's {self._deployed[pool]} at most)"
            prefill_why, decode_why = (prefill_why + clause, decode_why) if pool == "prefill" else (prefill_why, decode_why + clause)
        if idle_held:
            idle = f"; no request for {self._idle_s:.0f} s: the window keeps the traffic before it for up to {config.idle_hold_s:g} s idle"
            prefill_why, decode_why = prefill_why + idle, decode_why + idle
        if windowed["decode"] > counts["decode"]:
            decode_why = f"{decode_why}; the window's {self._quantile:g} quantile needs {windowed['decode']}"
        # Beyond the window: a load that has risen over each of the last k start-ups is a trend, and the
        # pool grows now to the load projected to when replicas asked for now are warm. That is a bet
        # unless the load already needs more than the deployment had: it is paid from savings.
        # A pool growing into a rise is not one balanced batch (its sequences stay where they
        # joined while new replicas start empty), so a trend is projected at each replica's own swing.
        own_decode_load, _ = self._decode_load(observed, None if stalled_need is not None else obs.decode_running, pooled=False)
        self.trend.observe((prefill_load, own_decode_load))
        self._account(obs, pools)
        rising, unfunded = {}, []
        needs, whys = {"prefill": prefill_need, "decode": decode_need}, {"prefill": prefill_why, "decode": decode_why}
        for pool, projected in self.trend.rises().items():
            if pool == "prefill":
                count = min(self._prefill_count(projected, prefill_cap), config.max_prefill)
            else:
                count = min(self._decode_count(projected), config.max_decode)
            if count <= needs[pool]:
                continue
            clause = f"rising over each of the last {self.trend.num_start_ups} start-ups, {count} for the load a start-up and half an interval ahead"
            cost_s = (count - max(needs[pool], pools[pool].target)) * (config.startup_s + config.interval_s)
            if config.trend_bets_from_savings and counts[pool] <= self._deployed[pool] and self._saved_s < cost_s:
                unfunded.append(pool)
                clause = f"{clause}, not bet on: {self._saved_s:.0f} replica-seconds saved below the deployment's {self._deployed[pool]}, {cost_s:.0f} needed"
            else:
                rising[pool], needs[pool] = needs[pool], count
            whys[pool] = f"{whys[pool]}; {clause}"
        # Below the deployment a rise over the last start-up is met ahead at once: up to the deployment a
        # rise that does not go on costs nothing a static split would not spend.
        self._rise_ahead.observe((prefill_load, own_decode_load))
        downs = {"prefill": prefill_need_down, "decode": decode_need_down}
        for pool in rising:  # nor does a pool shrink below a trend's projection while the load rises
            downs[pool] = max(downs[pool], needs[pool])
        if config.rise_ahead_below_deployment:
            for pool, projected in self._rise_ahead.rises().items():
                count = self._prefill_count(projected, prefill_cap) if pool == "prefill" else self._decode_count(projected)
                count = min(count, self._deployed[pool])
                if count > needs[pool]:
                    needs[pool], downs[pool] = count, max(count, downs[pool])  # nor does the pool shrink below it while it rises
                    growth = " at the growth of the last two intervals, which rose each" if pool in self._rise_ahead.at_latest else ""
                    whys[pool] = (
                        f"{whys[pool]}; rising over the last start-up, {count} for the load a start-up and half an interval ahead{growth}"
                        f" (the deployment's {self._deployed[pool]} at most)"
                    )
        prefill_need, decode_need = needs["prefill"], needs["decode"]
        prefill_need_down, decode_need_down = downs["prefill"], downs["decode"]
        prefill_why, decode_why = whys["prefill"], whys["decode"]
        # Beyond the window: a backlog that already makes a new prompt wait past the SLO means the
        # load is over capacity now; the pool grows to this interval's load plus the replicas that
        # clear the backlog within a start-up and an interval.
        backlog_s = obs.queued_prefill_tokens * self._seconds_per_token
        slack_s = config.ttft_slo_s - self._corrected_prefill_s()
        prefill_behind = backlog_s > slack_s * max(1, pools["prefill"].ready)
        if prefill_need > 0 and prefill_behind:
            clearing = self._prefill_count(max(prefill_load, smooth_prefill) + backlog_s / (config.startup_s + config.interval_s), prefill_cap)
            if clearing > prefill_need:
                prefill_need, prefill_why = clearing, f"{prefill_why}; {obs.queued_prefill_tokens} tokens queued"
        # The decode pool's backlog is its batch: an ITL over the SLO in each interval of the last
        # start-up means it is over capacity for longer than a replica takes to start, and it grows
        # to this interval's load rather than the start-up's average. A shorter spell is a burst the
        # pool rides out: replicas asked for on it would be warm after it.
        itl_over = obs.itl_s_p90 is not None and obs.itl_s_p90 > config.itl_slo_s
        self._itl_over_intervals = self._itl_over_intervals + 1 if itl_over else 0
        if self._itl_over_intervals >= self._loads.maxlen:
            now_need = self._decode_count(decode_load + (prefill_load if prefill_need == 0 else 0.0))
            if now_need > decode_need:
                decode_need, decode_why = now_need, f"{decode_why}; the ITL p90 {obs.itl_s_p90:.3f} s is over the SLO, {self._itl_over_intervals} intervals running"
        # Prompts queued behind that backlog are sequences on their way to the decode pool, which sees
        # them only once prefilled: it grows now for them and the running ones, so that its replicas
        # are warm when the backlog clears (prompts queued on decode replicas are the stalled batch's).
        coming = obs.queued_prefill_tokens - obs.decode_queued_prefill_tokens
        if prefill_behind and obs.decode_running is not None and obs.num_prompt_tokens > 0 and coming > 0:
            coming_requests = round(coming * obs.num_requests / obs.num_prompt_tokens)
            ahead_load, _ = self._decode_load(LoadForecast(0.0, 0.0, 0.0), obs.decode_running + coming_requests)
            now_need = self._decode_count(ahead_load)
            if now_need > decode_need:
                decode_need, decode_why = now_need, f"{decode_why}; {obs.decode_running} sequences running and {coming_requests} prompts queued for prefill behind its backlog"
        if stalled_need is not None:
            now_need = self._decode_count(stalled_need)
            if now_need > decode_need:
                decode_need, decode_why = now_need, f"{decode_why}; {obs.decode_running} sequences in a stalled batch"
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
                decode_need, decode_need_down = alone, alone_down
                if aggregated or (pools["decode"].ready >= max(alone, config.min_decode) and not pools["decode"].starting):
                    prefill_need = prefill_need_down = 0
                    prefill_why = f"{prefill_why}: the decode replicas prefill it themselves, {alone} of them instead of two pools"
                    added = alone - base["alone"]
                    grown = f", {added} more for what the decode load alone asks beyond its window ({decode_why})" if added > 0 else ""
                    decode_why = f"{observed.output_tokens_per_s:.0f} output tokens/s and every prompt, prefilled on the decode replicas{grown}"
                else:  # the prefill pool serves until every decode replica that takes its load over is ready
                    prefill_need = prefill_need_down = pools["prefill"].target
                    prefill_why = f"{prefill_why}: kept until {alone} decode replicas are ready to prefill it themselves"
        # Above the deployment, a burst is ridden out as a static split would ride it out.
        asked = {"prefill": prefill_need, "decode": decode_need}
        held = set()
        if not config.burst_growth_above_deployment:
            now = self._interval_counts(prefill_load, prefill_cap, decode_load, observed, obs.decode_running)  # this interval alone, not averaged
            needs, whys, held = self._ride_out_bursts(asked, {"prefill": prefill_why, "decode": decode_why}, now, pools, budget)
            prefill_need, decode_need, prefill_why, decode_why = needs["prefill"], needs["decode"], whys["prefill"], whys["decode"]
        decode = pools["decode"]
        if obs.kv_usage is not None and obs.kv_usage > config.kv_usage_high and decode.ready + 1 > decode_need:
            if self._only_infeasible(observed):  # a replica more holds more of them, and serves nobody in time
                decode_why = f"{decode_why}; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}, filled by prompts no replica prefills within the TTFT SLO: not grown for"
            elif not config.burst_growth_above_deployment and decode.ready + 1 > max(self._deployed["decode"], decode.target) and (budget or 0) > 0:
                # Above the deployment a full KV pool queues requests as a static split of it would, and
                # their misses are what the error budget counts.
                decode_why = f"{decode_why}; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}, but above the deployment's {self._deployed['decode']}{self._unspent(budget)}"
                held.add("decode")
            else:
                decode_need, decode_why = decode.ready + 1, f"{decode_why}; KV use {obs.kv_usage:.2f} is over {config.kv_usage_high:g}"

        targets, reasons, infeasible = {}, {}, []
        missing = {"prefill": (obs.ttft_s_p90 or 0.0) > config.ttft_slo_s, "decode": (obs.itl_s_p90 or 0.0) > config.itl_slo_s}
        for pool, need, need_down, why in (("prefill", prefill_need, prefill_need_down, prefill_why), ("decode", decode_need, decode_need_down, decode_why)):
            targets[pool], reasons[pool], flagged = self._settle(pool, need, need_down, pools[pool], obs.time_s, why, missing[pool])
            if flagged:
                infeasible.append(pool)
            # Replicas grown on a trend go once the load falls: back to what the pool had before the
            # rise or what the window needs now, whichever is more, with no cooldown (they were a bet).
            if pool in rising:
                if targets[pool] > pools[pool].target:
                    self._before_rise.setdefault(pool, pools[pool].target)
            elif pool in self._before_rise and self.trend.falling(pool):
                back = max(need, self._before_rise.pop(pool), config.min_prefill if pool == "prefill" else config.min_decode)
                if back < targets[pool]:
                    targets[pool], reasons[pool] = back, f"back to {back}: the rise is over ({why})"
                    self._last_change_s[pool] = obs.time_s
            # A pool whose load its target has carried for two start-ups has settled there: a rise
            # from it is a level of its own (the one it grew for before, if any, is its new normal).
            settled = self._steady[pool] >= self._within_needed  # before this interval
            self._steady[pool] = self._steady[pool] + 1 if counts[f"{pool}_down"] <= pools[pool].target else 0
            levels = self._levels[pool]
            # A run of load the deployment held the pool through is a level as much as one it grew for.
            held_here = pool in held and targets[pool] == pools[pool].target
            if (targets[pool] > pools[pool].target or held_here) and (not levels or settled):
                # The run began where the load last left what the pool had: the window lets a rise in late.
                levels.append(_Level(pools[pool].target, self._run_began_s(pool, pools[pool].target, obs.time_s), held=held_here))
            while levels and (targets[pool] < levels[-1].before or (targets[pool] == levels[-1].before and not levels[-1].held)):
                levels.pop()
        if infeasible_requests:
            reasons["prefill"] += f" ({infeasible_requests} requests had prompts no replica prefills within the TTFT SLO)"
        return Decision(
            obs.time_s, targets, {"prefill": prefill_need, "decode": decode_need}, forecast, dict(self.corrections), reasons,
            tuple(infeasible), infeasible_requests, tuple(released), tuple(unfunded), tuple(sorted(held)), room, self._saved_s, budget,
        )

    def _ride_out_bursts(
        self, needs: dict[str, int], whys: dict[str, str], now: dict[str, int], pools: Mapping[str, PoolReplicas], budget: float | None
    ) -> tuple[dict[str, int], dict[str, str], set[str]]:
        """Holds each pool at the deployment (or above it, where it already is) unless its load has
        needed more than the deployment in each interval of the last two start-ups and still does in
        this one alone (``now``, not averaged over a start-up: a burst's averaged tail is over), a
        shift that replicas asked for now still catch, and the SLO's error budget (``budget``, as
        ``_error_budget``) is spent; or unless the replica-seconds saved below the deployment pay for
        the replicas it adds, for a start-up and an interval. Returns the needs, the reasons and the
        pools held."""
        config = self.config
        needs, whys, held = dict(needs), dict(whys), set()
        for pool in POOLS:
            deployed = self._deployed[pool]
            floor = max(deployed, pools[pool].target)
            if needs[pool] <= floor:
                continue
            recent, unspent = self._recent, ""
            if len(recent) == recent.maxlen and now[pool] > deployed and all(counts[pool] > deployed for counts in recent):
                if budget is None or budget <= 0:
                    continue  # a shift: grows as asked
                unspent = f"; a shift, but{self._unspent(budget)}"  # the deployment serves it within the SLO, as a static split of it would
            high = config.max_prefill if pool == "prefill" else config.max_decode
            if floor >= high:
                continue  # nothing to add: settling holds it at max, and says so
            cost_s = (min(needs[pool], high) - floor) * (config.startup_s + config.interval_s)  # max is all it can add
            if self._saved_s >= cost_s:
                whys[pool] = f"{whys[pool]}; above the deployment's {deployed}, {cost_s:.0f} of the {self._saved_s:.0f} replica-seconds saved below it paid"
                self._saved_s -= cost_s
                continue
            whys[pool] = (
                f"{whys[pool]}; held at {floor} for {needs[pool]}: above the deployment's {deployed} a pool grows for load"
                f" that needed more over the last two start-ups, or on savings ({self._saved_s:.0f} replica-seconds, {cost_s:.0f} needed){unspent}"
            )
            needs[pool] = floor
            held.add(pool)
        return needs, whys, held

    def _error_budget(self) -> float | None:
        """Requests that may still miss an SLO over the budget's window before it is spent (below 0:
        overspent); None when it holds nothing (off, or no observation counted the misses). Until a
        whole window has been watched, its requests are those seen at their rate so far
        (``error_budget_extrapolated``)."""
        config = self.config
        if not config.error_budget_above_deployment or not self._misses:
            return None
        requests = sum(n for _, n, _ in self._misses)
        watched_s = self._misses[-1][0] - self._began_s
        if config.error_budget_extrapolated and 0 < watched_s < config.error_budget_window_s:
            requests *= config.error_budget_window_s / watched_s
        return (1 - config.attainment_target) * requests - sum(m for _, _, m in self._misses)

    def _unspent(self, budget: float) -> str:
        """The reason's clause for a pool held while the error budget (``budget`` requests) is not spent."""
        return (
            f" the SLO's error budget is not spent: {budget:.0f} more requests of the last"
            f" {self.config.error_budget_window_s:g} s may miss ({1 - self.config.attainment_target:.2g} of them)"
        )

    def _account(self, obs: Observation, pools: Mapping[str, PoolReplicas]) -> None:
        """Adds the interval just observed to the replica-seconds saved: each pool's count below the
        deployment (its target at the first decision), less the replicas a trend bet holds above what
        the pool had before the rise."""
        for pool in POOLS:
            deployed = self._deployed[pool]
            self._saved_s += max(0, deployed - pools[pool].target) * obs.duration_s
            if pool in self._before_rise:
                self._saved_s -= max(0, pools[pool].target - self._before_rise[pool]) * obs.duration_s

    def _measure_prompts(self, obs: Observation) -> int:
        """Learns from the interval's prompts and returns its infeasible requests: those whose prompt
        alone takes one replica longer than the TTFT SLO (corrected), known per histogram bucket (one
        whose lower bound is already too long). With the histogram it also tracks the prefill seconds a
        prompt token costs (prefill is convex in length) and the spread of the feasible prompts'
        prefill times, which lengthens queues: M/G/c waits are about (1 + cv^2) / 2 of M/M/c's."""
        perf, alpha = self.perf_model, (self.config.predictor_alpha if self._measured else 1.0)  # the first interval sets them
        if not obs.num_requests:
            return 0
        self._measured = True
        longest = perf.longest_prompt(self.config.ttft_slo_s / self.corrections["prefill"])
        infeasible, infeasible_s, seconds, tokens, lower = 0, 0.0, 0.0, 0.0, 0.0
        feasible = [0, 0.0, 0.0, 0.0]  # requests, tokens, seconds, seconds squared
        for upper, count in obs.prompt_length_counts:
            if count:
                middle = math.sqrt(max(lower, upper / 2) * upper) if math.isfinite(upper) else lower * math.sqrt(2)
                service_s = perf.prefill_s(middle)
                seconds, tokens = seconds + count * service_s, tokens + count * middle
                if lower >= longest:
                    infeasible, infeasible_s = infeasible + count, infeasible_s + count * service_s
                else:
                    feasible = [feasible[0] + count, feasible[1] + count * middle, feasible[2] + count * service_s, feasible[3] + count * service_s**2]
            lower = upper
        self._feasible_work = 1.0 - infeasible_s / seconds if seconds else 1.0
        if tokens:  # bucket middles, scaled to the interval's true token count
            self._seconds_per_token += alpha * (seconds / tokens - self._seconds_per_token)
            feasible_tokens = feasible[1] * obs.num_prompt_tokens / tokens
        else:
            feasible_tokens = obs.num_prompt_tokens
        if feasible[0] and feasible[2]:
            mean_s = feasible[2] / feasible[0]
            self._spread += alpha * ((1 + max(0.0, feasible[3] / feasible[0] / mean_s**2 - 1)) / 2 - self._spread)
        count = obs.num_requests - infeasible
        if count:
            self._prompt_tokens += alpha * (max(1.0, feasible_tokens / count) - self._prompt_tokens)
        if not tokens:
            self._seconds_per_token = perf.prefill_s(self._prompt_tokens) / self._prompt_tokens
        return infeasible

    def _interval_counts(self, prefill_load: float, prefill_cap: float, decode_load: float, observed: LoadForecast, running: int | None = None) -> dict[str, int]:
        """Replicas one interval's load needs per pool, to grow and (at each pool's scale-down margin)
        to shrink to, the decode pool taking the prompts when the prefill pool would be empty; and the
        decode replicas that would serve it all alone (``alone``, ``alone_down``; with ``running``
        sequences in their batches)."""
        margin, decode_margin = self.config.scale_down_margin, self.config.decode_scale_down_margin
        counts = {"prefill": self._prefill_count(prefill_load, prefill_cap), "prefill_down": self._prefill_count(prefill_load / margin, prefill_cap)}
        counts["decode"] = self._decode_count(decode_load + (prefill_load if counts["prefill"] == 0 else 0.0))
        counts["decode_down"] = self._decode_count((decode_load + (prefill_load if counts["prefill_down"] == 0 else 0.0)) / decode_margin)
        counts["alone"] = self._aggregated_count(prefill_load, prefill_cap, observed, running=running)
        counts["alone_down"] = self._aggregated_count(prefill_load / margin, prefill_cap, observed, margin, running)
        return counts

    def _window_add(self, now_s: float, counts: dict[str, int], weight: int) -> None:
        """Adds one interval's counts to the window and drops those older than ``window_s``."""
        window = self._window
        window.append([now_s, self._aged_s, max(weight, 1e-6), counts])
        while window[0][1] <= self._aged_s - self._window_s:
            window.popleft()

    def _remembered(self) -> list[list]:
        """The window's intervals, less those of the levels let go (the newest is always there)."""
        return [entry for entry in self._window if entry[3] is not None]

    def _release_levels(self, now_s: float, counts: dict[str, int]) -> dict[str, str]:
        """Lets go of the levels the pools grew for: a run of intervals whose load (averaged over a
        start-up, at the scale-down margin) the count the pool had before does not carry, that lasted
        at least ``release_level_after_s`` and has been followed by two start-ups that count carries.
        The window forgets the run's intervals and a start-up either side of it (loads are averaged
        over a start-up), for both pools (the level was the load's, and the other pool's counts in it
        were the level's too), so each pool shrinks to what the load outside the level needs, as the
        settling rules allow. Returns a clause per pool let go. A shorter run is a burst: the window
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
                if level.run_s is None or level.within < self._within_needed:
                    continue
                if now_s - level.within * interval_s - level.run_s + interval_s < self._level_s:
                    level.run_s = None  # a burst: the window remembers it
                elif let_go is None:
                    let_go = index  # the outermost over; those inside it are over too
            if let_go is None:
                continue
            level = levels[let_go]
            del levels[let_go:]
            before, run_s = level.before, level.run_s
            ended_s = now_s - level.within * interval_s
            self._before_rise.pop(pool, None)
            # Loads are averaged over a start-up, so a level's edges spread a start-up either side of it.
            edge_s = self.config.startup_s
            for entry in self._window:  # forgotten, and the level's rise with them: it was the shift's
                if run_s - edge_s <= entry[0] <= ended_s + edge_s:
                    entry[3] = None
            held_s = ended_s - run_s + interval_s
            held = f"{held_s / 60:.0f} minutes" if held_s >= 120 else f"{held_s:.0f} s"
            released[pool] = f"the level of {held} is over, {before} carried the last {level.within} intervals"
        return released

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
                if within >= self._within_needed:
                    return after_stretch_s
            else:
                within = 0
            newer_s = time_s
        return remembered[0][0]

    def _window_quantiles(self) -> dict[str, int]:
        """Each count's quantile over the intervals of the last ``window_s``, each weighted by its
        requests (attainment is counted in requests, and a busy interval holds more of them)."""
        remembered = self._remembered()
        return {key: self._weighted_quantile([(c[key], w) for _, _, w, c in remembered]) for key in remembered[-1][3]}

    def _rises(self) -> dict[str, int]:
        """Per pool, the quantile (as the window's, each interval weighted by its requests) of how far
        its count rose from an interval of the window's span within the reaction that followed it (a
        start-up and an interval), counting no rise that spans a level let go. Empty until the
        window holds one reaction."""
        window, reaction = list(self._window), self._reaction
        spans = [window[i:i + reaction + 1] for i in range(len(window) - reaction)]
        spans = [span for span in spans if all(entry[3] is not None for entry in span)]
        if not spans:
            return {}
        return {
            pool: self._weighted_quantile([(max(0, max(e[3][pool] for e in span[1:]) - span[0][3][pool]), span[0][2]) for span in spans])
            for pool in POOLS
        }

    def _weighted_quantile(self, values: list[tuple[int, float]]) -> int:
        """The ``base_quantile`` of (value, weight) pairs (not empty)."""
        total, seen = sum(w for _, w in values), 0.0
        for value, w in sorted(values):
            seen += w
            if seen >= self._quantile * total - 1e-9:
                return value
        return max(value for value, _ in values)

    def _correct(self, obs: Observation, pools: Mapping[str, PoolReplicas], decoded_per_s: float) -> None:
        """Updates the correction factors from the interval's mean latencies, sized on ready replicas
        (``decoded_per_s``: the tokens the decode pool made, each request's first left out)."""
        config, perf = self.config, self.perf_model
        ratios = {}
        # An interval in which a pool's ready count changed mixes two sizes: it corrects nothing.
        steady = {pool: pools[pool].ready == self._last_ready.get(pool) for pool in POOLS}
        self._last_ready = {pool: pools[pool].ready for pool in POOLS}
        prefill_ready = pools["prefill"].ready
        prompted = bool(obs.num_requests and obs.num_prompt_tokens)
        if prompted:  # the interval's mean prompt and what one replica takes to prefill it
            prompt_tokens = obs.num_prompt_tokens / obs.num_requests
            service_s = self._seconds_per_token * prompt_tokens  # the interval's mean prefill, convexity included
        if steady["prefill"] and obs.ttft_s_mean and prefill_ready and prompted:
            rho = obs.num_prompt_tokens / obs.duration_s * service_s / prompt_tokens / prefill_ready
            if rho < 0.7:  # beyond, the queueing term dominates and says little about the model
                ratios["prefill"] = obs.ttft_s_mean / (service_s * (1 + self._spread * pooled_wait_share(rho, prefill_ready)))
        decode_ready = pools["decode"].ready
        if steady["decode"] and obs.itl_s_mean and decode_ready and decoded_per_s:
            batch = decoded_per_s * obs.itl_s_mean / decode_ready
            stalled = 0.0
            if not prefill_ready and prompted:  # the decode replicas prefilled: their batches stalled meanwhile
                stalled = min(0.9, obs.num_requests / obs.duration_s * service_s / decode_ready)
            ratios["decode"] = obs.itl_s_mean * (1 - stalled) / perf.itl_s(batch)
        for pool, ratio in ratios.items():
            ratio = min(config.correction_max, max(config.correction_min, ratio))
            self.corrections[pool] += config.correction_smoothing * (ratio - self.corrections[pool])

    def _corrected_prefill_s(self) -> float:
        """What one replica takes to prefill the mean feasible prompt, corrected by observed TTFT."""
        return self.corrections["prefill"] * self._seconds_per_token * self._prompt_tokens

    def _prefill_load(self, load: LoadForecast) -> tuple[float, float, str]:
        """(load in prefill replicas, highest load per replica alone that meets the TTFT SLO or 0, why)."""
        config = self.config
        prompt_tokens = self._prompt_tokens
        service_s = self._seconds_per_token * prompt_tokens
        wait_scale_s = self._corrected_prefill_s()
        replicas = load.prompt_tokens_per_s * self._seconds_per_token
        why = f"{load.prompt_tokens_per_s:.0f} prompt tokens/s, {prompt_tokens:.0f} a prompt at {service_s:.3f} s each"
        # Prompts no replica prefills within the SLO hold replicas the others would wait for, so their
        # work counts while there are others to keep waiting: with next to none, it is left out.
        if self._only_infeasible(load):
            feasible = replicas * self._feasible_work
            why = f"{why}; {replicas - feasible:.1f} replicas of it prompts no replica prefills within the TTFT SLO, left out: the others are {feasible:.2f}"
            replicas = feasible
        if wait_scale_s >= config.ttft_slo_s:
            return replicas, 0.0, why
        low, high, tail = 0.0, 1.0, 1 - config.attainment_target
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if wait_tail(mid, wait_scale_s, config.ttft_slo_s - wait_scale_s) <= tail else (low, mid)
        return replicas, low, why

    def _only_infeasible(self, load: LoadForecast) -> bool:
        """Whether next to all of the interval's prompt work is prompts no replica prefills within the
        TTFT SLO: theirs over ``prefill_zero_load`` replicas, the others' under it (nobody to protect)."""
        replicas = load.prompt_tokens_per_s * self._seconds_per_token
        return replicas * self._feasible_work < self.config.prefill_zero_load < replicas

    def _prefill_count(self, load: float, per_replica: float) -> int:
        """Fewest prefill replicas sharing one queue (the router sends each prompt to the least queued)
        whose Erlang-C wait tail keeps ``1 - attainment_target`` of the prompts over the TTFT SLO;
        ``per_replica`` is 0 when the mean prompt alone is slower than the SLO."""
        config = self.config
        if per_replica == 0:
            return config.max_prefill + 1
        if load < config.prefill_zero_load:
            return 0
        service_s = self._corrected_prefill_s()
        slack = (config.ttft_slo_s - service_s) / service_s
        for count in range(max(1, math.ceil(load - 1e-9)), config.max_prefill + 2):
            if count > load and erlang_c(count, load) * math.exp(-(count - load) * slack / self._spread) <= 1 - config.attainment_target:
                return count
        return config.max_prefill + 1

    def _aggregated_count(self, prefill_load: float, prefill_cap: float, forecast: LoadForecast, margin: float = 1.0, running: int | None = None) -> int:
        """Fewest decode replicas that also prefill every prompt: each spends ``prefill_load / n`` of
        its time prefilling (at most the TTFT's ``prefill_cap``), its batch stalls meanwhile, so the
        ITL it must keep while decoding shrinks by that share and so does its token rate. The
        ``running`` sequences (when known) must fit their batches at that ITL too: the decoded tokens
        lag a batch that long answers fill. More than ``max_decode`` when no count serves both."""
        config = self.config
        for n in range(1, config.max_decode + 1):
            stalled = prefill_load / n
            if stalled > prefill_cap or stalled >= 1:
                continue
            rate = self._decode_rate(config.itl_slo_s * (1 - stalled), n)
            if rate is None or forecast.output_tokens_per_s / margin > n * (1 - stalled) * rate[1]:
                continue
            if not config.aggregated_counts_running or running is None or running / margin <= n * rate[0]:
                return n
        return config.max_decode + 1

    def _decode_rate(self, itl_s: float, replicas: int = 1) -> tuple[float, float] | None:
        """(batch, tokens/s) of one of ``replicas`` decode replicas whose corrected ITL stays under
        ``itl_s``: the largest such batch less its share of the pool's Poisson swing, z * sqrt(batch
        / replicas) (the router joins each sequence to the smallest batch, so the pool's running
        sequences swing as one Poisson count). None when even one sequence is slower."""
        perf, correction = self.perf_model, self.corrections["decode"]
        batch_at_slo = perf.largest_batch(itl_s / correction, self.config.max_decode_batch)
        if batch_at_slo == 0:
            return None
        z = self._z / math.sqrt(replicas) if self.config.decode_swing_pooled else self._z
        batch = max(1.0, ((-z + math.sqrt(z**2 + 4 * batch_at_slo)) / 2) ** 2)
        return batch, batch / (correction * perf.itl_s(batch))

    def _decode_count(self, load: float) -> int:
        return self.config.max_decode + 1 if math.isinf(load) else max(1, math.ceil(load - 1e-9))

    def _decode_load(self, forecast: LoadForecast, running: int | None = None, pooled: bool = True) -> tuple[float, str]:
        """(load in decode replicas, why); infinite when no batch meets the ITL SLO. The decoded
        tokens lag the sequences that have joined a batch (a long answer streams for minutes), so the
        sequences running now, at one replica's batch, count when they are more. ``pooled``: each
        replica keeps room for its share of the pool's swing (``decode_swing_pooled``), not its own."""
        for replicas in range(1, self.config.max_decode + 1):
            # Each replica's share of the swing shrinks as the pool grows: the load is the one the
            # fewest replicas that carry it see, at most that many replicas.
            rate = self._decode_rate(self.config.itl_slo_s, replicas)
            if rate is None:  # whatever the pool's size
                return math.inf, f"one sequence alone takes {self.corrections['decode'] * self.perf_model.itl_s(1):.3f} s per token"
            batch, tokens_per_s = rate
            load, why = forecast.output_tokens_per_s / tokens_per_s, f"{forecast.output_tokens_per_s:.0f} output tokens/s at {tokens_per_s:.0f} per replica (batch {batch:.0f})"
            if running is not None and running / batch > load:
                load, why = running / batch, f"{running} sequences running at a batch of {batch:.0f} per replica ({forecast.output_tokens_per_s:.0f} output tokens/s)"
            if load <= replicas or not (pooled and self.config.decode_swing_pooled):
                break
        return load, why

    def _stabilised(self, pool: str, need_down: int, now_s: float) -> int:
        """The most ``need_down`` asked for over the last ``scale_down_window_s`` (this one included)."""
        recent = self._recent_down[pool]
        recent.append((now_s, need_down))
        while len(recent) > 1 and recent[0][0] <= now_s - self.config.scale_down_window_s:
            recent.popleft()
        return max(n for _, n in recent)

    def _settle(self, pool: str, need: int, need_down: int, replicas: PoolReplicas, now_s: float, why: str, missing_slo: bool) -> tuple[int, str, bool]:
        """(target, reason, infeasible) for one pool, from what it needs to grow and to shrink."""
        config = self.config
        low, high = (config.min_prefill, config.max_prefill) if pool == "prefill" else (config.min_decode, config.max_decode)
        current = replicas.target
        target, flagged = current, False
        this_interval, need_down = need_down, self._stabilised(pool, need_down, now_s)
        warming = self._aged_s < self._warmup_s and need_down < current
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
            reason = f"holding at {current}: {self._aged_s:.0f} s of the {self._warmup_s:.0f} s window observed, too few to shrink on"
        elif need_down < current and replicas.starting:
            reason = f"holding at {current}: {replicas.starting} replicas still starting"
        elif need_down < current and missing_slo:
            reason = f"holding at {current}: the SLO was missed last interval"
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
            self._last_change_s[pool] = now_s
        return target, reason, flagged
