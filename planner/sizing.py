"""Replica counts for a load: the perf model, corrected by what the replicas were observed to do.

``ReplicaSizer`` turns a load (tokens/s, sequences running) into the replicas each pool needs to
meet its SLO. It learns as it goes, once an interval, from ``SLAPlanner.decide``:

    observation ──► measure_prompts ──► infeasible prompts apart, prefill seconds a token, spread
         └────────► correct ──────────► corrections (observed/predicted latency, clamped, smoothed)

and sizes with what it learned: ``prefill_load`` / ``decode_load`` (a load in replicas),
``prefill_count`` / ``decode_count`` (replicas for it) and ``interval_counts`` (an interval's
counts per pool, to grow and to shrink to, and the decode replicas that would serve it alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist

from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.observation import Observation
from planner.perf_model import PerfModel
from planner.predictor import LoadForecast
from planner.queueing import erlang_c, pooled_wait_share, wait_tail


class ReplicaSizer:
    """Replica counts for a load, from the perf model corrected by what the replicas were observed to do.

    It keeps state between intervals: ``corrections`` (observed over predicted latency per pool),
    ``seconds_per_token`` (the prefill seconds a prompt token costs, prefill being convex in length)
    and ``spread`` ((1 + cv^2) / 2 of the feasible prompts' prefill times), so call
    ``measure_prompts`` and ``correct`` once per interval, in order, before sizing on it.
    """

    def __init__(self, config: PlannerConfig, perf_model: PerfModel) -> None:
        self.config = config
        self.perf_model = perf_model
        self.corrections = {pool: 1.0 for pool in POOLS}
        self._last_ready: dict[str, int] = {}
        self._prompt_tokens = float(perf_model.prefill[0][0])  # the mean feasible prompt
        self.seconds_per_token = perf_model.prefill_s(self._prompt_tokens) / self._prompt_tokens
        self.spread = 1.0
        self._measured = False
        self.z = NormalDist().inv_cdf(config.attainment_target)  # the normal quantile at the attainment target
        self._feasible_work = 1.0  # the share of the last interval's prefill seconds that were feasible prompts'

    def measure_prompts(self, obs: Observation) -> int:
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
            self.seconds_per_token += alpha * (seconds / tokens - self.seconds_per_token)
            feasible_tokens = feasible[1] * obs.num_prompt_tokens / tokens
        else:
            feasible_tokens = obs.num_prompt_tokens
        if feasible[0] and feasible[2]:
            mean_s = feasible[2] / feasible[0]
            self.spread += alpha * ((1 + max(0.0, feasible[3] / feasible[0] / mean_s**2 - 1)) / 2 - self.spread)
        count = obs.num_requests - infeasible
        if count:
            self._prompt_tokens += alpha * (max(1.0, feasible_tokens / count) - self._prompt_tokens)
        if not tokens:
            self.seconds_per_token = perf.prefill_s(self._prompt_tokens) / self._prompt_tokens
        return infeasible

    def correct(self, obs: Observation, pools: Mapping[str, PoolReplicas], decoded_per_s: float) -> None:
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
            service_s = self.seconds_per_token * prompt_tokens  # the interval's mean prefill, convexity included
        if steady["prefill"] and obs.ttft_s_mean and prefill_ready and prompted:
            rho = obs.num_prompt_tokens / obs.duration_s * service_s / prompt_tokens / prefill_ready
            if rho < 0.7:  # beyond, the queueing term dominates and says little about the model
                ratios["prefill"] = obs.ttft_s_mean / (service_s * (1 + self.spread * pooled_wait_share(rho, prefill_ready)))
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

    def corrected_prefill_s(self) -> float:
        """What one replica takes to prefill the mean feasible prompt, corrected by observed TTFT."""
        return self.corrections["prefill"] * self.seconds_per_token * self._prompt_tokens

    def prefill_load(self, load: LoadForecast) -> tuple[float, float, str]:
        """(load in prefill replicas, highest load per replica alone that meets the TTFT SLO or 0, why)."""
        config = self.config
        prompt_tokens = self._prompt_tokens
        service_s = self.seconds_per_token * prompt_tokens
        wait_scale_s = self.corrected_prefill_s()
        replicas = load.prompt_tokens_per_s * self.seconds_per_token
        why = f"{load.prompt_tokens_per_s:.0f} prompt tokens/s, {prompt_tokens:.0f} a prompt at {service_s:.3f} s each"
        # Prompts no replica prefills within the SLO hold replicas the others would wait for, so their
        # work counts while there are others to keep waiting: with next to none, it is left out.
        if self.only_infeasible(load):
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

    def only_infeasible(self, load: LoadForecast) -> bool:
        """Whether next to all of the interval's prompt work is prompts no replica prefills within the
        TTFT SLO: theirs over ``prefill_zero_load`` replicas, the others' under it (nobody to protect)."""
        replicas = load.prompt_tokens_per_s * self.seconds_per_token
        return replicas * self._feasible_work < self.config.prefill_zero_load < replicas

    def prefill_count(self, load: float, per_replica: float) -> int:
        """Fewest prefill replicas sharing one queue (the router sends each prompt to the least queued)
        whose Erlang-C wait tail keeps ``1 - attainment_target`` of the prompts over the TTFT SLO;
        ``per_replica`` is 0 when the mean prompt alone is slower than the SLO."""
        config = self.config
        if per_replica == 0:
            return config.max_prefill + 1
        if load < config.prefill_zero_load:
            return 0
        service_s = self.corrected_prefill_s()
        slack = (config.ttft_slo_s - service_s) / service_s
        for count in range(max(1, math.ceil(load - 1e-9)), config.max_prefill + 2):
            if count > load and erlang_c(count, load) * math.exp(-(count - load) * slack / self.spread) <= 1 - config.attainment_target:
                return count
        return config.max_prefill + 1

    def count(self, pool: str, load: float, prefill_cap: float) -> int:
        """Replicas of ``pool`` for ``load`` (in replicas): ``prefill_count`` or ``decode_count``."""
        return self.prefill_count(load, prefill_cap) if pool == "prefill" else self.decode_count(load)

    def decode_rate(self, itl_s: float, replicas: int = 1) -> tuple[float, float] | None:
        """(batch, tokens/s) of one of ``replicas`` decode replicas whose corrected ITL stays under
        ``itl_s``: the largest such batch less its share of the pool's Poisson swing, z * sqrt(batch
        / replicas) (the router joins each sequence to the smallest batch, so the pool's running
        sequences swing as one Poisson count). None when even one sequence is slower."""
        perf, correction = self.perf_model, self.corrections["decode"]
        batch_at_slo = perf.largest_batch(itl_s / correction, self.config.max_decode_batch)
        if batch_at_slo == 0:
            return None
        z = self.z / math.sqrt(replicas) if self.config.decode_swing_pooled else self.z
        batch = max(1.0, ((-z + math.sqrt(z**2 + 4 * batch_at_slo)) / 2) ** 2)
        return batch, batch / (correction * perf.itl_s(batch))

    def decode_count(self, load: float) -> int:
        """Decode replicas for ``load`` (in replicas, as ``decode_load`` gives it): its ceiling, at least
        one; ``max_decode + 1`` when it is infinite (no batch meets the ITL SLO)."""
        return self.config.max_decode + 1 if math.isinf(load) else max(1, math.ceil(load - 1e-9))

    def decode_load(self, forecast: LoadForecast, running: int | None = None, pooled: bool = True) -> tuple[float, str]:
        """(load in decode replicas, why); infinite when no batch meets the ITL SLO. The decoded
        tokens lag the sequences that have joined a batch (a long answer streams for minutes), so the
        sequences running now, at one replica's batch, count when they are more. ``pooled``: each
        replica keeps room for its share of the pool's swing (``decode_swing_pooled``), not its own."""
        for replicas in range(1, self.config.max_decode + 1):
            # Each replica's share of the swing shrinks as the pool grows: the load is the one the
            # fewest replicas that carry it see, at most that many replicas.
            rate = self.decode_rate(self.config.itl_slo_s, replicas)
            if rate is None:  # whatever the pool's size
                return math.inf, f"one sequence alone takes {self.corrections['decode'] * self.perf_model.itl_s(1):.3f} s per token"
            batch, tokens_per_s = rate
            load, why = forecast.output_tokens_per_s / tokens_per_s, f"{forecast.output_tokens_per_s:.0f} output tokens/s at {tokens_per_s:.0f} per replica (batch {batch:.0f})"
            if running is not None and running / batch > load:
                load, why = running / batch, f"{running} sequences running at a batch of {batch:.0f} per replica ({forecast.output_tokens_per_s:.0f} output tokens/s)"
            if load <= replicas or not (pooled and self.config.decode_swing_pooled):
                break
        return load, why

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
            rate = self.decode_rate(config.itl_slo_s * (1 - stalled), n)
            if rate is None or forecast.output_tokens_per_s / margin > n * (1 - stalled) * rate[1]:
                continue
            if not config.aggregated_counts_running or running is None or running / margin <= n * rate[0]:
                return n
        return config.max_decode + 1

    def interval_counts(self, prefill_load: float, prefill_cap: float, decode_load: float, observed: LoadForecast, running: int | None = None) -> dict[str, int]:
        """Replicas one interval's load needs per pool, to grow and (at each pool's scale-down margin)
        to shrink to, the decode pool taking the prompts when the prefill pool would be empty; and the
        decode replicas that would serve it all alone (``alone``, ``alone_down``; with ``running``
        sequences in their batches)."""
        margin, decode_margin = self.config.scale_down_margin, self.config.decode_scale_down_margin
        counts = {"prefill": self.prefill_count(prefill_load, prefill_cap), "prefill_down": self.prefill_count(prefill_load / margin, prefill_cap)}
        counts["decode"] = self.decode_count(decode_load + (prefill_load if counts["prefill"] == 0 else 0.0))
        counts["decode_down"] = self.decode_count((decode_load + (prefill_load if counts["prefill_down"] == 0 else 0.0)) / decode_margin)
        counts["alone"] = self._aggregated_count(prefill_load, prefill_cap, observed, running=running)
        counts["alone_down"] = self._aggregated_count(prefill_load / margin, prefill_cap, observed, margin, running)
        return counts
