"""The SLA planner's settings: the SLOs it holds, how often it decides, and how it damps itself."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner aims for and the limits it keeps (defaults fit llama2-70b on H100, TP 4)."""

    ttft_slo_s: float = 2.0
    """Time to first token each request should meet."""
    itl_slo_s: float = 0.1
    """Mean inter-token latency each request should meet."""
    attainment_target: float = 0.95
    """Share of requests that should meet both SLOs; sets the queueing headroom of both pools."""
    interval_s: float = 30.0
    """Seconds between decisions; each observation covers one interval."""
    min_prefill: int = 0
    """Fewest prefill replicas; 0 lets the pool empty when prompts are few (decode prefills locally)."""
    max_prefill: int = 16
    """Most prefill replicas."""
    min_decode: int = 1
    """Fewest decode replicas (at least 1: someone has to decode)."""
    max_decode: int = 16
    """Most decode replicas."""
    scale_down_cooldown_s: float = 300.0
    """A pool shrinks only this long after its last change (growing is never held back)."""
    scale_down_window_s: float = 0.0
    """Stabilisation window (Kubernetes HPA's ``behavior.scaleDown.stabilizationWindowSeconds``): a
    pool shrinks only to the most it would have shrunk to in any interval of this many seconds. 0
    uses each interval alone. Longer windows flap less and cost more replica-hours (planner/EXPERIMENTS.md)."""
    flap_limit_per_hour: int = 6
    """At or below its deployment a pool changes direction at most this many times in any hour: it
    does not turn down where that would leave no room within the hour for the turn up that may have
    to follow, and holds instead, at no more than a static split of the deployment spends (half the
    issue's bound of 12). A load that sits at a count's edge for hours (a day's sine between 1 and 6
    req/s, on its way through 2 req/s) otherwise has a rise met ahead on its noise and let go after
    the cooldown, again and again: 15 changes of direction in one hour (planner/EXPERIMENTS.md,
    sixteenth session). Growing is never held back, and above the deployment (replicas paid from
    savings) a pool goes down as before. 0: off."""
    base_quantile: float | None = None
    """The quantile of per-interval need (each interval weighted by its requests) the pools are sized
    for; None: ``attainment_target``."""
    base_window_s: float | None = None
    """The span of intervals that quantile is taken over; None: ``(startup_s + interval_s) / (1 -
    base_quantile)`` (at least four intervals), so that a rise enters it once it has lasted about as
    long as replicas asked for at its first decision take to be warm."""
    rise_start_ups: int | None = None
    """A load that has risen over each of this many consecutive start-ups is a trend: the pool grows at
    once to the load projected a start-up and half an interval ahead, and goes back when the load falls.
    None: the fewest k whose (k + 1)! reaches both the window's intervals and 1 / (1 -
    attainment_target) (noise alone rises so often at most about once a window and in at most the miss
    share of the intervals; 4 with the defaults); 0: off."""
    trend_bets_from_savings: bool = True
    """A trend's projection above what the window needs is a bet. With this on it is placed only when
    the newest start-up's load already needs more replicas than the pool had when the planner started
    (the deployment it was turned on over), or when the replica-seconds the pools have spent below that
    deployment, less those earlier bets held, pay for it (the replicas it adds, for a start-up and an
    interval). A planner is then never above its deployment on a guess it has not saved for. Off:
    every trend is bet on (a few percent more replica-hours on steady traffic, planner/README)."""
    savings_pay_while_above: bool = True
    """A pool grown above its deployment on the replica-seconds saved below it (not for a shift once
    the SLO's error budget is spent) pays for its replicas above the deployment for every interval it
    keeps them, not once for their start-up, and goes back to the deployment once the savings are
    spent: its replica-hours stay within the deployment's. Off: the start-up and an interval are
    paid once and the replicas stay while the load needs them (prompt_drift at 4x its load: 1.011x
    static's replica-hours, at 0.994 against its 0.965; planner/README)."""
    savings_count_drains: bool = True
    """Replicas let go are paid for until they have drained, and the replica-seconds saved below the
    deployment say so: each decode replica a decision lets go is charged its expected drain (the
    longest of its running sequences: Little's law's time in decode times the harmonic number of its
    share of them), and growth above the deployment on savings must also pay for the drain of the
    replicas it adds, and goes back once the savings no longer do. Off: the account follows the
    targets alone, and growth on savings can end over the deployment's replica-hours by the drains it
    did not count (answer_bursts at 4x its load: 1.007x static's; planner/README)."""
    burst_memory_above_deployment: bool = False
    """Let the window's memory of a burst hold a pool above the deployment (its target at the
    planner's first decision, what the SRE chose for this traffic) for the whole window, and the
    warm-up hold what the planner grew above it. Off: above the deployment a pool holds only what the
    last two start-ups needed (a burst's recurrence is a guess; the deployment is the bar), goes back
    to it without waiting for the cooldown, and the warm-up holds the deployment's count, not growth
    above it (planner/README)."""
    burst_growth_above_deployment: bool = False
    """Let a pool grow above the deployment for any load the window or the backlog rules ask for.
    Off: above the deployment a pool grows only for load that has needed more than the deployment in
    each interval of the last two start-ups (a shift, which replicas asked for now still catch), or
    when the replica-seconds the pools have saved below the deployment pay for the replicas it adds
    (for a start-up and an interval, as a trend bet). The deployment rides out shorter bursts, as a
    static split would: replicas asked for on them are warm after most of them (planner/README). A
    KV pool nearly full still grows the decode pool at once."""
    error_budget_above_deployment: bool = True
    """Above the deployment, a shift grows a pool only once the SLO's error budget is spent: the
    requests that missed an SLO over the last ``error_budget_window_s`` (less those whose prompt no
    replica prefills in time, counted apart) reach ``1 - attainment_target`` of its requests. Until
    then the deployment serves the shift as a static split of it would, within what the SLO allows;
    a drift that a static split of the deployment rides out at the target costs no replica more.
    Growth the savings below the deployment pay for is not held. Needs observations that count the
    misses (``Observation.slo_misses``); without them, and off, a shift grows at once."""
    error_budget_window_s: float = 3600.0
    """The span the error budget is counted over: an hour, so that a quiet morning's unspent budget
    does not hold the deployment through an evening's overload."""
    error_budget_extrapolated: bool = True
    """Until the planner has watched a whole ``error_budget_window_s``, the window's requests are
    those it has seen at the rate it has seen them: twelve minutes into the hour, five times what
    they were. Off, an overload early in the planner's first hour finds a budget sized for the few
    requests seen so far, and grows past the deployment that a static split of it would serve
    within the target over the hour (fresh bursty seed 116, minute 12: 1.006x static's
    replica-hours at static's attainment)."""
    rise_step_below_deployment: float = 2.0
    """Below the deployment, a pool that must grow asks for this many times the step from its target
    to what it needs (at most the deployment): replicas asked for now are warm a start-up later, and
    a rise that has begun mostly goes on that long, while replicas up to the deployment spend nothing
    a static split of it would not (planner/README). 1: only what the load needs now."""
    rise_room_below_deployment: bool = True
    """Below the deployment, keep each pool room for the load's own rises: its count now plus the
    ``base_quantile`` of how far its count rose (over the window, each interval weighted by its
    requests) within a start-up and an interval, the time from a rise's first interval to the
    replicas it asks for being warm; at most the deployment. A rise of a level let go (a shift, over)
    is forgotten with it. Off: the pools are sized for the load that has been, not for how fast it
    has changed; replicas up to the deployment cost nothing a static split of it would not spend
    (planner/README)."""
    rises_weighted_at_peak: bool = True
    """Weigh each rise the room is kept for by the requests of the busiest interval it rose to, the
    requests the room is for. Off: by the requests of the interval it rose from, so a rise out of a
    quiet spell, the one that catches a pool shrunk there, weighs least; a rise once a window then
    sits at the quantile's edge (its reaction's intervals are 5% of the window's). Measured in
    planner/EXPERIMENTS.md (thirteenth session)."""
    rise_ahead_below_deployment: bool = True
    """Below the deployment, meet a rise ahead without waiting for a trend: a load whose average over
    the last start-up is above the one before grows the pool at once to the count for that load
    grown on at that rate (a surge grows by a factor, not a step) to the middle of the first
    interval replicas asked for now serve, at most the deployment, and the pool does not shrink
    below that count while the load rises. Up to the deployment a rise that does not go on costs
    nothing a static split of it would not spend, so the trend test's run of start-ups, which
    guards bets beyond it, is not waited for. Off: below the deployment too, only a trend runs
    ahead (planner/README)."""
    rise_ahead_at_latest_growth: bool = True
    """With ``rise_ahead_below_deployment``: a load that rose in each of the last two intervals is
    also projected at their growth an interval, and the pool grows for the larger projection. A
    surge that accelerates (23k, 25k, then 31k prompt tokens/s, then 44k) outgrows the start-up
    averages, which see it an interval late; below the deployment an overshoot costs nothing a
    static split of it would not spend. Off: the start-up averages' growth alone (planner/README)."""
    lengthening_ahead_below_deployment: bool = True
    """Below the deployment, meet lengthening answers ahead. Little's law: the running count over the
    request rate is how long a sequence runs. A running count above what the interval's rate keeps
    at the longest run time of the window's intervals, past that count's Poisson swing, and grown
    past its own swing since the interval before, is answers lengthening (a rising rate keeps the
    run time): the decode pool grows at once to the running count grown on at its last interval's
    growth to the middle of the first interval replicas asked for now serve, at most the deployment.
    The decoded tokens lag such a rise by as long as the answers stream. Off: the running count
    counts as it stands (planner/README)."""
    hold_deployment_until_needed_s: float | None = None
    """Below its deployment a pool shrinks only once an interval's load (averaged over a start-up) has
    needed the deployment's count, or after this many seconds observed (None: no limit): a launch
    protection, the deployment taken as the SRE's word on the peak to expect until the load has
    reached it once. Until then the window has seen nothing of how the load rises to it, and a
    first-time step soon after a shrink on flat load is a miss no reaction catches
    (planner/EXPERIMENTS.md, fourteenth session: the development set with its seeds, the outside
    shapes and those at 4x met the three targets on 216 of 222 replays with an hour, 209 without).
    Any limit is a first-time step's chance: an hour shrank square_60's pools in the interval its
    first step came (fifteenth session), so by default the deployment stays until the load needs
    it; a deployment sized above any load it sees then saves nothing, and its SRE sets a limit. As
    KEDA's ``initialCooldownPeriod`` (whose default is 0). 0: off, the window alone decides from the
    warm-up's end."""
    level_memory_lengths: float = 2.0
    """Below the deployment, a level of load is kept for this many times as long as it held after it
    ended, and a reaction more (a start-up and an interval), where that is longer than the window:
    the pool does not shrink below the level's count before then. The window alone remembers a level
    for the window after it ends, so a level about as long as the window is let go just as a load
    with a period of twice the window brings it back, into pools shrunk the interval before; twice its
    length keeps a level through a quiet spell as long again as the level and the level itself once
    more (a load on for a third of each period; planner/EXPERIMENTS.md, fifteenth session). A level's
    run allows gaps shorter than two start-ups (the stretch within a lower count that ends a level the
    pool grew for). Levels that this keeps no longer than the window are left to the window and to
    ``release_level_after_s``. 0: off, the window alone."""
    level_memory_max_s: float | None = None
    """The longest a level is kept after it ended (``level_memory_lengths``); None: four times the
    window (2 hours with the defaults). The memory is for a load that comes back after a quiet spell
    about as long as itself, a step no reaction catches; a level of hours that ends is most often a
    day's peak, which comes back as a ramp the window and the trend rule meet, and kept twice its
    length it would pin the pools at the peak through the trough (a day's sine between 1 and 6
    req/s: prefill held at the peak's 2 for the 22 hours after a level of 11; planner/EXPERIMENTS.md,
    sixteenth session)."""
    release_level_after_s: float | None = None
    """A level of load a pool grew for and that held at least this long is a shift, not a burst:
    once the load has stayed within the count the pool had before for two start-ups, the window
    forgets the level's intervals and both pools shrink to what the load outside it needs (a shorter
    burst stays remembered for the window, so that one recurring finds its replicas warm). None:
    k + 3 start-ups, the trend test's span (k + 1, k as ``rise_start_ups`` derives it) and the two
    start-ups the load must stay within (7 minutes with the defaults; 5 lost a bursty trace
    attainment, planner/EXPERIMENTS.md); ``math.inf``: never, the window alone."""
    idle_hold_s: float = 3600.0
    """Intervals with no request at all are no evidence that the load before them is gone: for this
    long an idle stretch does not age the window (nor count towards the warm-up), so the pools keep
    what the traffic before it needed, and a deployment that starts idle keeps what it was deployed
    with. Past it the deployment is taken as unused and the window ages again (the pools go to
    their minimum a window later). 0: idle time ages the window like any other."""
    scale_down_margin: float = 0.8
    """Hysteresis of the prefill pool: it shrinks only to a count that would carry the load at this
    share of its capacity (its Erlang-C count is optimistic for heavy-tailed prompts; at 0.9 or 1
    heavy-tailed and spell traces lost attainment, planner/EXPERIMENTS.md)."""
    decode_scale_down_margin: float = 1.0
    """Hysteresis of the decode pool, as ``scale_down_margin``. 1 (none) by default: a replica's
    batch already keeps room for the pool's swing, and 0.8 held bursty traces'
    decode pools up to two replicas above what their window needed for half an hour (planner/EXPERIMENTS.md)."""
    decode_swing_pooled: bool = True
    """Size the decode pool for the swing of all its running sequences together: the router joins
    each sequence to the smallest batch, so n replicas each keep z * sqrt(batch / n) of room, not
    z * sqrt(batch). A trend's projection keeps each replica's own (planner/EXPERIMENTS.md)."""
    prefill_zero_load: float = 0.1
    """Prompt load, in prefill replicas, below which the prefill pool may go to zero (with min_prefill 0)."""
    aggregate_when_cheaper: bool = False
    """Empty the prefill pool whenever the decode replicas alone, each prefilling its share of the
    prompts, need fewer replicas than two pools do, not only below ``prefill_zero_load``. Cheaper
    on steady traffic, slower to recover from prompt bursts (measured in planner/EXPERIMENTS.md). Either
    way a prefill pool already at zero stays there while the decode replicas carry it all."""
    aggregated_counts_running: bool = True
    """Count the decode replicas that serve it all alone (an aggregated cluster, or one entering it)
    for the sequences running now as well as for the tokens decoded: each must fit a batch at the
    ITL its prefilling leaves. Long answers fill the batches for minutes before the decoded tokens
    show it (a crowd whose answers grow 8x missed 2.6% of a run that static served whole).
    Off: the decoded tokens alone (planner/README)."""
    aggregated_keeps_rises: bool = True
    """An aggregated cluster's decode pool grows, beyond what its window's count needs, by as many
    replicas as the rules beyond the window (a rise met ahead, a trend, an ITL over the SLO for a
    start-up, a stalled batch) ask of the decode pool over its window's count. Off: the window's
    count alone sizes it while the cluster stays aggregated (planner/README)."""
    max_decode_batch: int = 256
    """Most sequences one decode replica runs at once (its KV capacity), whatever the ITL allows."""
    kv_usage_high: float = 0.9
    """Decode KV use above which the decode pool grows by one whatever the model says."""
    kv_holds_decode: bool = True
    """Nor does the decode pool shrink to fewer replicas than would hold the KV in use, grown by its
    swing (z at the attainment target over the root of the running count), under
    ``kv_usage_high``: long prompts fill a replica's KV before its batch reaches what the ITL allows,
    and a pool sized on output tokens alone gives back the replica the KV rule grew and takes it again
    an interval later (outside long_context at 4x its load: 33 decode direction changes in an hour).
    Off: the KV rule grows, and the load's count shrinks (planner/README)."""
    correction_min: float = 0.5
    """Lowest observed/predicted latency ratio the planner believes."""
    correction_max: float = 2.0
    """Highest observed/predicted latency ratio the planner believes."""
    correction_smoothing: float = 0.5
    """Weight of the newest ratio in the running correction factor (1: only the newest)."""
    startup_s: float = 60.0
    """Seconds a new replica takes to become ready; the load forecast looks this far past the next interval."""
    predictor_alpha: float = 0.5
    """Weight of the newest interval in the forecast's level."""
    predictor_beta: float = 0.5
    """Weight of the newest change of level in the forecast's trend (0: no trend). A burst rises
    over two or three intervals, so the growth factor must follow within about two (at 0.3, the
    bursty replays in bench.planner lost up to 7 points of SLO attainment to late replicas)."""

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "itl_slo_s", "interval_s", "error_budget_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0 seconds, got {getattr(self, name)}.")
        if not 0 < self.attainment_target < 1:
            raise ValueError(f"attainment_target must be between 0 and 1 (exclusive), got {self.attainment_target}.")
        if not 0 <= self.min_prefill <= self.max_prefill or self.max_prefill < 1:
            raise ValueError(f"min_prefill and max_prefill must satisfy 0 <= min <= max and max >= 1, got {self.min_prefill} and {self.max_prefill}.")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"min_decode and max_decode must satisfy 1 <= min <= max, got {self.min_decode} and {self.max_decode}.")
        if not (self.level_memory_lengths >= 0 and math.isfinite(self.level_memory_lengths)):
            raise ValueError(f"level_memory_lengths must be 0 (off) or more, got {self.level_memory_lengths}.")
        if self.flap_limit_per_hour < 0:
            raise ValueError(f"flap_limit_per_hour must be 0 (off) or more, got {self.flap_limit_per_hour}.")
        if self.level_memory_max_s is not None and not self.level_memory_max_s >= 0:
            raise ValueError(f"level_memory_max_s must be 0 or more (None: four windows), got {self.level_memory_max_s}.")
        for name in ("scale_down_cooldown_s", "scale_down_window_s", "idle_hold_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}.")
        if not self.rise_step_below_deployment >= 1:
            raise ValueError(f"rise_step_below_deployment must be 1 or more, got {self.rise_step_below_deployment}.")
        for name in ("scale_down_margin", "decode_scale_down_margin", "correction_smoothing", "predictor_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}.")
        if not 0 <= self.predictor_beta <= 1:
            raise ValueError(f"predictor_beta must be in [0, 1], got {self.predictor_beta}.")
        if self.base_quantile is not None and not 0 < self.base_quantile <= 1:
            raise ValueError(f"base_quantile must be in (0, 1], got {self.base_quantile}.")
        if self.rise_start_ups is not None and self.rise_start_ups < 0:
            raise ValueError(f"rise_start_ups must be 0 or more, got {self.rise_start_ups}.")
        if self.hold_deployment_until_needed_s is not None and not self.hold_deployment_until_needed_s >= 0:
            raise ValueError(f"hold_deployment_until_needed_s must be 0 (off) or more, got {self.hold_deployment_until_needed_s}.")
        if self.release_level_after_s is not None and not self.release_level_after_s >= 0:
            raise ValueError(f"release_level_after_s must be 0 or more (inf: never), got {self.release_level_after_s}.")
        if self.base_window_s is not None and self.base_window_s < self.interval_s:
            raise ValueError(f"base_window_s must be at least interval_s ({self.interval_s}), got {self.base_window_s}.")
        if self.startup_s < 0:
            raise ValueError(f"startup_s must be 0 or more, got {self.startup_s}.")
        if not 0 <= self.prefill_zero_load < 1:
            raise ValueError(f"prefill_zero_load must be in [0, 1) prefill replicas, got {self.prefill_zero_load}.")
        if self.max_decode_batch < 1:
            raise ValueError(f"max_decode_batch must be at least 1, got {self.max_decode_batch}.")
        if not 0 < self.kv_usage_high <= 1:
            raise ValueError(f"kv_usage_high must be in (0, 1], got {self.kv_usage_high}.")
        if not 0 < self.correction_min <= 1 <= self.correction_max:
            raise ValueError(f"correction_min and correction_max must satisfy 0 < min <= 1 <= max, got {self.correction_min} and {self.correction_max}.")
