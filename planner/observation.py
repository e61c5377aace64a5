"""The planner's input and output: what the cluster did in an interval, and what the planner wants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from planner.predictor import LoadForecast


@dataclass(frozen=True)
class Observation:
    """What the cluster did in the interval that just ended (the series Prometheus scrapes)."""

    time_s: float
    """End of the interval on the planner's clock (monotonic seconds); cooldowns are measured on it."""
    duration_s: float
    """Length of the interval."""
    num_requests: int
    """Requests that arrived."""
    num_prompt_tokens: int
    """Prompt tokens of those requests."""
    num_output_tokens: int
    """Output tokens streamed in the interval (the routers' ``splitserve_output_tokens``), whichever
    request they belong to."""
    ttft_s_mean: float | None = None
    """Mean TTFT of requests whose first token came in the interval (None: none came)."""
    ttft_s_p90: float | None = None
    """90th percentile of the same."""
    itl_s_mean: float | None = None
    """Mean ITL of requests that finished in the interval (None: none finished)."""
    itl_s_p90: float | None = None
    """90th percentile of the same."""
    queued_prefill_tokens: int = 0
    """Prompt tokens waiting or being prefilled at the end of the interval, on every replica (a
    decode replica prefills its own when the prefill pool is empty, or as a fallback)."""
    kv_usage: float | None = None
    """Decode pool: share of its KV blocks in use at the end of the interval (None: unknown)."""
    prompt_length_counts: tuple[tuple[float, int], ...] = ()
    """Requests of the interval by prompt length: (upper bound in tokens, count) per histogram bucket,
    bounds rising, the last one inf (router.frontend.metrics.PROMPT_LENGTH_BUCKETS; empty: unknown). The
    planner counts the prompts no replica prefills within the TTFT SLO apart from the rest."""
    decode_running: int | None = None
    """Decode pool: sequences being decoded at the end of the interval, all replicas together
    (None: unknown)."""
    decode_queued_prefill_tokens: int = 0
    """The part of ``queued_prefill_tokens`` on decode replicas: their batches stall while they
    prefill it."""
    slo_misses: int | None = None
    """Requests that missed an SLO in the interval: their first token came later than the TTFT SLO,
    or they finished at a mean inter-token latency over the ITL SLO (one that missed both counts
    twice). None: not counted (the planner's error budget then holds nothing)."""

    def __post_init__(self) -> None:
        counts = (self.num_requests, self.num_prompt_tokens, self.num_output_tokens, self.queued_prefill_tokens, self.decode_queued_prefill_tokens, self.slo_misses or 0)
        if self.duration_s <= 0 or min(counts) < 0:
            raise ValueError("an observation needs duration_s above 0 and no negative count.")


@dataclass(frozen=True)
class Decision:
    """What the planner wants, and why."""

    time_s: float
    """The observation's time."""
    targets: Mapping[str, int]
    """Replicas each pool should be set to."""
    needed: Mapping[str, int]
    """Replicas the corrected model says each pool needs, before hysteresis, cooldown and limits."""
    forecast: LoadForecast
    """The load the targets are sized for."""
    corrections: Mapping[str, float]
    """Observed/predicted latency factor per pool (TTFT for prefill, ITL for decode)."""
    reasons: Mapping[str, str]
    """One sentence per pool saying why its target is what it is."""
    infeasible: tuple[str, ...] = ()
    """Pools whose SLO no allowed count meets: held at max and reported (an event per interval)."""
    infeasible_requests: int = 0
    """Requests of the interval whose prompt no replica prefills within the TTFT SLO (their prefill
    alone takes longer): counted and reported apart, they never drive the prefill pool to max."""
    released_levels: tuple[str, ...] = ()
    """Pools whose level of load (a run longer than a burst, now over) the planner let go this
    interval: the window forgot its intervals, so the pools shrink to what the load outside it needs."""
    unfunded_trends: tuple[str, ...] = ()
    """Pools whose load was a trend this interval but whose projection was not bet on: the load did not
    yet need more than the deployment had, and the replica-seconds saved did not pay for the bet."""
    held_at_deployment: tuple[str, ...] = ()
    """Pools whose load asked for more than the deployment this interval and that were held where
    they are: a burst ridden out as a static split would ride it out, not yet a shift (two start-ups)
    and not paid for by savings (``burst_growth_above_deployment`` off)."""
    rise_room: Mapping[str, int] = field(default_factory=dict)
    """Per pool whose count room for the load's own rises raised this interval (below the
    deployment, ``rise_room_below_deployment``): the rise in replicas the window saw within a
    start-up and an interval, kept on top of the count the load needs now."""
    saved_replica_s: float = 0.0
    """Replica-seconds the pools have spent below the deployment the planner was turned on over (their
    targets at its first decision), less those trend bets held: what the next bet is paid from."""
    error_budget: float | None = None
    """Requests that may still miss an SLO over the error budget's window before it is spent
    (``1 - attainment_target`` of its requests, less those that missed; below 0: overspent). None:
    the observations do not count misses, or ``error_budget_above_deployment`` is off."""
    launch_protected: tuple[str, ...] = ()
    """Pools launch protection keeps from going below their deployment after this interval: no
    interval's load has needed the deployment's count yet, within ``hold_deployment_until_needed_s``
    observed."""
    long_levels: Mapping[str, int] = field(default_factory=dict)
    """Per pool that a long level keeps from shrinking further this interval (below the deployment,
    ``level_memory_lengths``): the count it keeps. A level is kept for twice as long after it ended
    as it held (by default), where that is longer than the window, and four windows at most."""
    direction_changes: Mapping[str, int] = field(default_factory=dict)
    """Per pool, its changes of direction (a change up after one down, or down after one up) within
    the last hour, this interval's included (``flap_limit_per_hour``)."""
    flap_held: tuple[str, ...] = ()
    """Pools ``flap_limit_per_hour`` held this interval rather than turning them down again."""
