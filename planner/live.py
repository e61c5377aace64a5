"""The planner beside a running cluster: every interval, observe, decide, act.

::

    ClusterSource.observe()  ─ the routers' series (planner/scrape.py) + the replicas' queues and KV use
            │                   (from the router's Admin.GetClusterStatus)
            ▼
    SLAPlanner.decide(observation, connector.pools())   (planner/policy.py: no I/O)
            │
            ▼
    connector.set_replicas(pool, target)   for every pool whose target changed (not with --dry-run)

Every decision is logged with its inputs as one JSON line and exported as ``splitserve_planner_*``
metrics. A connector that fails is logged and counted, and the planner waits a doubling backoff
before it acts again; it never stops. A pool whose SLO no allowed count meets is reported once per
interval (a warning and ``splitserve_planner_infeasible_total``) while the planner holds it at max.
A level of load let go (planner/window.py) counts in ``splitserve_planner_levels_released_total``; a
trend not bet on in ``splitserve_planner_trends_not_bet_total``, a burst ridden out at the deployment
in ``splitserve_planner_bursts_ridden_out_total``, the room kept below it for the load's own rises
is ``splitserve_planner_rise_room_replicas``, the replica-seconds bets and growth above the
deployment are paid from are ``splitserve_planner_saved_replica_seconds``, a pool launch
protection keeps at its deployment is 1 in ``splitserve_planner_launch_protection``, and the count a
long level keeps a pool at below it is ``splitserve_planner_long_level_replicas``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.connector import POOLS, Connector, ConnectorError
from planner.observation import Decision, Observation
from planner.policy import SLAPlanner
from planner.scrape import Scrape, count_above, interval, scrape

logger = logging.getLogger(__name__)


class ClusterSource:
    """Observations of a cluster through its router's gRPC admin API (``status()``: a callable
    returning splitserve.v1.ClusterStatus, e.g. ``SplitServeClient.cluster_status``)."""

    def __init__(self, status, slos: tuple[float, float] | None = None) -> None:
        self._status = status
        self._slos = slos
        """(TTFT, ITL) SLOs in seconds: the requests that missed them are counted from the routers'
        histograms (``Observation.slo_misses``); None: not counted."""
        self._last: Scrape | None = None

    async def observe(self, now_s: float) -> Observation | None:
        """The interval since the previous call; None on the first call (it only takes the baseline)."""
        status = await asyncio.to_thread(self._status)
        urls = [r.metrics_url for r in status.routers if r.metrics_url]
        current = await asyncio.to_thread(scrape, urls, now_s)
        previous, self._last = self._last, current
        if previous is None:
            return None
        stats = interval(previous, current)
        slo_misses = None
        if self._slos is not None:  # from the histograms: exact when an SLO is a bucket bound
            ttft_slo_s, itl_slo_s = self._slos
            late = count_above(ttft_slo_s, previous.buckets.get("ttft", {}), current.buckets.get("ttft", {}))
            slow = count_above(itl_slo_s, previous.buckets.get("request_itl", {}), current.buckets.get("request_itl", {}))
            if late is not None and slow is not None:
                slo_misses = round(late + slow)
        decode = [r for r in status.replicas if r.pool == "decode" and r.num_kv_blocks]
        # Prompt tokens waiting for a prefill anywhere: on the prefill replicas, and on decode
        # replicas that prefill their own (the prefill pool at zero, or a fallback).
        prefill_queue = sum(r.num_queued_prefill_tokens for r in status.replicas)
        decode_queue = sum(r.num_queued_prefill_tokens for r in status.replicas if r.pool == "decode")
        kv_usage = None
        if decode:
            kv_usage = sum(r.num_kv_blocks - r.num_free_kv_blocks for r in decode) / sum(r.num_kv_blocks for r in decode)
        return Observation(
            time_s=now_s,
            duration_s=stats.duration_s,
            num_requests=round(stats.requests),
            num_prompt_tokens=round(stats.prompt_tokens),
            num_output_tokens=round(stats.output_tokens),
            ttft_s_mean=stats.ttft_mean_s,
            ttft_s_p90=stats.ttft_p90_s,
            itl_s_mean=stats.itl_mean_s,
            itl_s_p90=stats.itl_p90_s,
            queued_prefill_tokens=prefill_queue,
            kv_usage=kv_usage,
            prompt_length_counts=stats.prompt_length_counts,
            decode_running=sum(r.num_running for r in status.replicas if r.pool == "decode"),
            decode_queued_prefill_tokens=decode_queue,
            slo_misses=slo_misses,
        )


class PlannerMetrics:
    """``splitserve_planner_*``: desired, needed and ready replicas per pool, the forecast, the corrections, events."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.desired = Gauge("splitserve_planner_desired_replicas", "Replicas the planner set the pool to.", ["pool"], registry=r)
        self.needed = Gauge("splitserve_planner_needed_replicas", "Replicas the corrected model says the pool needs.", ["pool"], registry=r)
        self.ready = Gauge("splitserve_planner_ready_replicas", "Warm replicas of the pool at the decision.", ["pool"], registry=r)
        self.correction = Gauge("splitserve_planner_correction_factor", "Observed over predicted latency, per pool.", ["pool"], registry=r)
        self.forecast = Gauge("splitserve_planner_predicted_load", "The load the targets are sized for.", ["quantity"], registry=r)
        self.infeasible = Counter("splitserve_planner_infeasible", "Intervals a pool's SLO could not be met by any allowed count.", ["pool"], registry=r)
        self.infeasible_requests = Counter(
            "splitserve_planner_infeasible_requests", "Requests whose prompt no replica prefills within the TTFT SLO, counted apart.", registry=r
        )
        self.levels_released = Counter(
            "splitserve_planner_levels_released", "Levels of load (runs longer than a burst, now over) the planner let go: the window forgot them.", ["pool"], registry=r
        )
        self.trends_not_bet = Counter(
            "splitserve_planner_trends_not_bet", "Intervals a pool's load was a trend whose projection was not bet on: not yet over the deployment, and not paid for by savings.", ["pool"], registry=r
        )
        self.bursts_ridden_out = Counter(
            "splitserve_planner_bursts_ridden_out",
            "Intervals a pool's load asked for more than the deployment and the pool was held: a burst, not yet a shift, and not paid for by savings.",
            ["pool"], registry=r,
        )
        self.rise_room = Gauge(
            "splitserve_planner_rise_room_replicas",
            "The rise in replicas the window saw within a start-up and an interval, kept as room below the deployment this interval (0: none kept).",
            ["pool"], registry=r,
        )
        self.saved = Gauge(
            "splitserve_planner_saved_replica_seconds", "Replica-seconds spent below the deployment the planner started over, less trend bets held: what a bet is paid from.", registry=r
        )
        self.long_level = Gauge(
            "splitserve_planner_long_level_replicas",
            "The count a long level keeps the pool at (or above) below its deployment this interval: a level is kept twice as long after it as it held, where that is longer than the window, and four windows at most (0: none kept).",
            ["pool"], registry=r,
        )
        self.direction_changes = Gauge(
            "splitserve_planner_direction_changes_last_hour",
            "The pool's changes of direction (up after down, or down after up) within the last hour; at or below its deployment it makes at most flap_limit_per_hour.",
            ["pool"], registry=r,
        )
        self.flap_holds = Counter(
            "splitserve_planner_flap_holds_total", "Intervals the flap limit held the pool rather than turning it down again.", ["pool"], registry=r
        )
        self.launch_protection = Gauge(
            "splitserve_planner_launch_protection",
            "1 while launch protection keeps the pool from going below its deployment (no interval's load has needed it yet), else 0.",
            ["pool"],
            registry=r,
        )
        self.error_budget = Gauge(
            "splitserve_planner_error_budget_requests",
            "Requests that may still miss an SLO over the error budget's window before a shift grows a pool above its deployment (below 0: overspent).",
            registry=r,
        )
        self.connector_errors = Counter("splitserve_planner_connector_errors", "Actions the cluster refused or failed.", registry=r)
        self.decisions = Counter("splitserve_planner_decisions", "Intervals decided.", registry=r)


class PlannerLoop:
    """Runs ``planner`` against ``connector`` every ``interval_s``; ``dry_run`` only logs."""

    def __init__(
        self, planner: SLAPlanner, connector: Connector, source: ClusterSource, *, dry_run: bool = False,
        metrics: PlannerMetrics | None = None, backoff_s: float = 5.0, max_backoff_s: float = 300.0,
    ) -> None:
        self.planner = planner
        self.connector = connector
        self.source = source
        self.dry_run = dry_run
        self.metrics = metrics or PlannerMetrics()
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._failures = 0
        self._resume_s = 0.0
        self.decisions: list[Decision] = []
        """Every decision so far, oldest first."""

    async def step(self, now_s: float | None = None) -> Decision | None:
        """One interval: observe, decide, act. None while the first observation is being taken."""
        now_s = time.monotonic() if now_s is None else now_s
        observation = await self.source.observe(now_s)
        if observation is None:
            return None
        try:
            pools = await self.connector.pools()
        except ConnectorError as e:
            self._failed(now_s, e)
            return None
        decision = self.planner.decide(observation, pools)
        self.decisions.append(decision)
        self._record(observation, pools, decision)
        if self.dry_run or now_s < self._resume_s:
            return decision
        for pool in POOLS:
            if decision.targets[pool] == pools[pool].target:
                continue
            try:
                await self.connector.set_replicas(pool, decision.targets[pool])
            except ConnectorError as e:
                self._failed(now_s, e)
                break
        else:
            self._failures = 0
        return decision

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Step every ``interval_s`` until ``stop`` is set; an error in a step is logged, never fatal."""
        while not stop.is_set():
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - a planner that crashes scales nothing
                logger.exception("planner: interval failed; trying again next interval")
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    def _failed(self, now_s: float, error: ConnectorError) -> None:
        self._failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self._failures - 1))
        self._resume_s = now_s + delay
        self.metrics.connector_errors.inc()
        logger.warning("planner: connector failed (%s); acting again in %.0f s", error, delay)

    def _record(self, observation: Observation, pools, decision: Decision) -> None:
        m = self.metrics
        m.decisions.inc()
        for pool in POOLS:
            m.desired.labels(pool).set(decision.targets[pool])
            m.needed.labels(pool).set(decision.needed[pool])
            m.ready.labels(pool).set(pools[pool].ready)
            m.correction.labels(pool).set(decision.corrections.get(pool, 1.0))
        forecast = decision.forecast
        m.forecast.labels("request_rate").set(forecast.request_rate)
        m.forecast.labels("prompt_tokens_per_s").set(forecast.prompt_tokens_per_s)
        m.forecast.labels("output_tokens_per_s").set(forecast.output_tokens_per_s)
        for pool in decision.infeasible:
            m.infeasible.labels(pool).inc()
            logger.warning("planner: no allowed %s count meets its SLO; holding at max (%s)", pool, decision.reasons.get(pool, ""))
        m.infeasible_requests.inc(decision.infeasible_requests)
        for pool in decision.released_levels:
            m.levels_released.labels(pool).inc()
        for pool in decision.unfunded_trends:
            m.trends_not_bet.labels(pool).inc()
        for pool in decision.held_at_deployment:
            m.bursts_ridden_out.labels(pool).inc()
        for pool in POOLS:
            m.rise_room.labels(pool).set(decision.rise_room.get(pool, 0))
            m.launch_protection.labels(pool).set(1 if pool in decision.launch_protected else 0)
            m.long_level.labels(pool).set(decision.long_levels.get(pool, 0))
            m.direction_changes.labels(pool).set(decision.direction_changes.get(pool, 0))
        for pool in decision.flap_held:
            m.flap_holds.labels(pool).inc()
        m.saved.set(decision.saved_replica_s)
        if decision.error_budget is not None:
            m.error_budget.set(decision.error_budget)
        logger.info("planner: %s", json.dumps({
            "observation": _loggable(observation),
            "pools": {p: dataclasses.asdict(v) for p, v in pools.items()},
            "targets": dict(decision.targets), "needed": dict(decision.needed),
            "forecast": dataclasses.asdict(forecast), "corrections": dict(decision.corrections),
            "reasons": dict(decision.reasons), "infeasible": list(decision.infeasible),
            "infeasible_requests": decision.infeasible_requests, "released_levels": list(decision.released_levels),
            "unfunded_trends": list(decision.unfunded_trends), "held_at_deployment": list(decision.held_at_deployment),
            "rise_room": dict(decision.rise_room), "saved_replica_s": round(decision.saved_replica_s, 1),
            "error_budget": None if decision.error_budget is None else round(decision.error_budget, 1),
            "launch_protected": list(decision.launch_protected), "long_levels": dict(decision.long_levels),
            "direction_changes": dict(decision.direction_changes), "flap_held": list(decision.flap_held), "dry_run": self.dry_run,
        }))


def _loggable(observation: Observation) -> dict:
    """The observation as strict JSON: prompt lengths as {upper bound: count} of the buckets that
    counted any, the last bound spelled "+Inf" as Prometheus does (JSON has no infinity)."""
    out = dataclasses.asdict(observation)
    out["prompt_length_counts"] = {("+Inf" if math.isinf(b) else f"{b:g}"): n for b, n in observation.prompt_length_counts if n}
    return out
