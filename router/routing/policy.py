"""Routing policies: which prefill worker computes a prompt, which decode worker streams it.

Every policy sees the same inputs — the prompt's block keys, the prefix index, each worker's
load — and returns a ``Decision``. ``splitserve`` is the cost model below; ``round_robin``,
``least_loaded`` and ``sglang_cache_aware`` are the baselines it is measured against
(bench/routing.py replays traces through all four).

The cost model, per prefill worker ``w``, in tokens of prefill work::

    cost(w) = queued_prefill_tokens(w)                                        work waiting there
            + (prefill_weight + queue_weight * num_queued_requests(w)) * uncached(w)  its work
            + balance_weight * (recent_work(w) - min recent_work)                 sticky follow-ups
            + decode_weight * decode_load(w)                                   (0 by default)

    uncached(w) = prompt_tokens - B * (pool + cpu + redis)(w)           computed
                + B * cpu(w) * prefill_rate / cpu_load_rate                 loaded from CPU
                + B * redis(w) * prefill_rate / redis_load_rate             loaded from Redis

where ``pool/cpu/redis`` are the blocks of the prompt's cached run on ``w`` by serving tier:
``uncached(w) / prefill_rate`` is this prompt's own time on ``w`` (compute plus tier loads, as
Dynamo's and llm-d's scorers estimate it), so every term is in tokens of prefill time and a tier
is worth what its load speed says, not a fitted credit (the speeds are the cluster's: measure
them, bench.kv_store does). ``prefill_weight`` > 1 makes new work count for more than waiting
work: the queue delays one request, while recomputing a prefix another worker holds costs the
whole cluster.
New work also delays every request that will queue behind it, and a worker's queue predicts
how many will: hence ``queue_weight`` per request queued there at the last report. Without it,
a burst that lengthens the queues makes the policy move sessions off their cache holders, the
moves recompute whole histories, the queues grow and more sessions move (bench.routing saw
this collapse at ~50% load). ``recent_work(w)`` is the uncached work this router sent ``w``
before its last report (what it sent since is in the queue term), averaged over
``balance_window_s``: sessions stick to their worker, so a worker that got more work lately
will get more follow-ups, and new sessions lean away from it. The lowest cost wins; ties go to
the lower queue, then round robin. With a ``temperature`` the choice is a softmax over
``-cost / (temperature * prompt_tokens)``.

Recent decisions: a burst of requests that share a new prefix arrives before any KV event says
where it landed, so the policy has the index remember, for ``memory_s``, the worker it sent each
prompt's new blocks to, and counts them as that worker's pool hits (they expire at load reports,
off the request's path). It also adds each decision's work to that
worker's queue until the next load report, so a burst spreads by cost instead of piling onto
the worker that looked idlest at the last report. A prefix every request shares (one system
prompt) is cached everywhere after its first few requests, so it stops telling workers apart
and the queue term decides: it cannot pin traffic to one worker.

Conditional disaggregation: when the best decode worker lacks at most
``local_prefill_max_tokens`` of the prompt, the decode worker prefills it itself.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_store.events import Tier
from router.config import POLICIES
from router.routing.prefix_index import CachedRun, PrefixIndex



@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as last reported, plus what this router sent it since."""

    worker_id: str
    queued_prefill_tokens: int = 0
    """Prompt tokens waiting to be prefilled (or being prefilled) on the worker."""
    num_queued_requests: int = 0
    """Requests waiting or prefilling on the worker."""
    decode_load: float = 0.0
    """Running sequences plus KV pool use (decode workers)."""


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    block_keys: Sequence[int]
    """Keys of the prompt's full blocks, in order."""
    num_prompt_tokens: int
    block_size: int


@dataclass(frozen=True)
class Decision:
    prefill: str | None
    """The prefill worker, or None: the decode worker prefills the prompt itself."""
    decode: str | None
    """The decode worker (None when the policy routes prefill only, as in the replay)."""
    cached: CachedRun = CachedRun()
    """The cached run the chosen prefill (or decode) worker holds."""
    cost: float = 0.0


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the splitserve policy."""

    prefill_tokens_per_s: float = 10_000.0
    """Prompt tokens a prefill worker computes per second."""
    cpu_load_tokens_per_s: float = 300_000.0
    """Cached tokens a worker loads from its CPU tier per second."""
    redis_load_tokens_per_s: float = 30_000.0
    """Cached tokens a worker loads from the Redis tier per second."""
    memory_s: float = 2.0
    """How long the policy counts its own recent decisions as cached blocks."""
    temperature: float = 0.0
    """Softmax temperature over costs (0: always the cheapest)."""
    local_prefill_max_tokens: int = 0
    """Let the decode worker prefill when it lacks at most this many prompt tokens (0: never)."""
    prefill_weight: float = 2.0
    """Weight of this prompt's uncached tokens against tokens already queued on the worker."""
    queue_weight: float = 1.0
    """Extra weight of this prompt's uncached tokens per request queued on the worker (last report)."""
    balance_weight: float = 0.25
    """Cost per token of recent work sent to a worker beyond the least busy one's."""
    balance_window_s: float = 30.0
    """Time constant of the recent-work average (about how long a session stays on a worker)."""
    decode_weight: float = 0.0
    """Tokens of cost per unit of decode load on a worker that also decodes."""

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "cpu_load_tokens_per_s", "redis_load_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.memory_s < 0 or self.temperature < 0 or self.local_prefill_max_tokens < 0:
            raise ValueError("memory_s, temperature and local_prefill_max_tokens: must be >= 0")
        if min(self.prefill_weight, self.queue_weight, self.balance_weight) < 0:
            raise ValueError("prefill_weight, queue_weight and balance_weight: must be >= 0")
        if self.balance_window_s <= 0:
            raise ValueError(f"balance_window_s: must be > 0, got {self.balance_window_s}")


class RoutingPolicy:
    """Base: what every policy shares (the index, the clock, pending work since the last report)."""

    name = ""

    def __init__(self, index: PrefixIndex, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.clock = clock
        self._sent: dict[str, list[int]] = {}
        """Per worker: [tokens, requests] sent since its last load report."""

    def report(self, load: WorkerLoad) -> None:
        """A fresh load report: it includes what this router sent before it."""
        self._sent.pop(load.worker_id, None)

    def choose(self, request: RouteRequest, prefill: Sequence[WorkerLoad], decode: Sequence[WorkerLoad] = ()) -> Decision:
        if not prefill and not decode:
            raise ValueError("no workers to route to")
        decision = self._choose(request, list(prefill), list(decode))
        if decision.prefill is not None:
            uncached = request.num_prompt_tokens - decision.cached.blocks * request.block_size
            sent = self._sent.setdefault(decision.prefill, [0, 0])
            sent[0] += max(0, uncached)
            sent[1] += 1
        return decision

    def queued_tokens(self, load: WorkerLoad) -> int:
        return load.queued_prefill_tokens + self._sent.get(load.worker_id, (0, 0))[0]

    def queued_requests(self, load: WorkerLoad) -> int:
        return load.num_queued_requests + self._sent.get(load.worker_id, (0, 0))[1]

    def pick_decode(self, decode: Sequence[WorkerLoad]) -> str | None:
        return min(decode, key=lambda w: (w.decode_load, w.worker_id)).worker_id if decode else None

    def _choose(self, request: RouteRequest, prefill: list[WorkerLoad], decode: list[WorkerLoad]) -> Decision:
        raise NotImplementedError


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, index: PrefixIndex, clock=time.monotonic) -> None:
        super().__init__(index, clock)
        self._counter = itertools.count()

    def _choose(self, request, prefill, decode):
        worker = sorted(prefill, key=lambda w: w.worker_id)[next(self._counter) % len(prefill)].worker_id
        return Decision(worker, self.pick_decode(decode), self.index.match(request.block_keys, [worker])[worker])


class LeastLoaded(RoutingPolicy):
    """The worker with the fewest queued prefill tokens."""

    name = "least_loaded"

    def _choose(self, request, prefill, decode):
        worker = min(prefill, key=lambda w: (self.queued_tokens(w), w.worker_id)).worker_id
        return Decision(worker, self.pick_decode(decode), self.index.match(request.block_keys, [worker])[worker])


class SGLangCacheAware(RoutingPolicy):
    """SGLang router's published rule: balance when load is skewed (max - min > 64 and
    max > 1.5 x min, load = queued requests), else the best prefix match if its match rate is
    above 0.3, else the worker with the smallest cache."""

    name = "sglang_cache_aware"
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5
    cache_threshold = 0.3

    def _choose(self, request, prefill, decode):
        loads = {w.worker_id: self.queued_requests(w) for w in prefill}
        runs = self.index.match(request.block_keys, loads)
        most, least = max(loads.values()), min(loads.values())
        if most - least > self.balance_abs_threshold and most > self.balance_rel_threshold * least:
            worker = min(loads, key=lambda w: (loads[w], w))
        else:
            best = max(loads, key=lambda w: (runs[w].pool + runs[w].cpu, -loads[w], w))
            rate = (runs[best].pool + runs[best].cpu) * request.block_size / max(1, request.num_prompt_tokens)
            if rate > self.cache_threshold:
                worker = best
            else:
                worker = min(loads, key=lambda w: (self.index.num_keys(w, Tier.POOL), loads[w], w))
        return Decision(worker, self.pick_decode(decode), runs[worker])


class SplitservePolicy(RoutingPolicy):
    """The cost model of this module's docstring."""

    name = "splitserve"

    def __init__(self, index: PrefixIndex, config: PolicyConfig = PolicyConfig(), clock=time.monotonic, seed: int = 0) -> None:
        super().__init__(index, clock)
        self.config = config
        self._rng = random.Random(seed)
        self._counter = itertools.count()
        self._recent_work: dict[str, float] = {}
        """Per worker: uncached tokens sent before its last report, decayed over ``balance_window_s``."""
        self._recent_work_at = clock()
        self._cpu_cost = config.prefill_tokens_per_s / config.cpu_load_tokens_per_s
        self._redis_cost = config.prefill_tokens_per_s / config.redis_load_tokens_per_s

    def _choose(self, request, prefill, decode):
        config = self.config
        keys = request.block_keys
        decode_id = self.pick_decode(decode)
        if decode_id is not None and config.local_prefill_max_tokens:
            run = self.index.match(keys, [decode_id])[decode_id]
            if request.num_prompt_tokens - run.blocks * request.block_size <= config.local_prefill_max_tokens or not prefill:
                return Decision(None, decode_id, run)
        if not prefill:
            return Decision(None, decode_id, self.index.match(keys, [decode_id])[decode_id])
        self._expire_if_late()
        found = self.index.lookup(keys)  # one find of the keys for the match and the memory
        runs = self.index.match(found, [w.worker_id for w in prefill])
        recent_work = self._decayed_recent_work()
        least_recent_work = min(recent_work.get(w.worker_id, 0.0) for w in prefill)
        costs = {}
        for load in prefill:
            work = self.work_tokens(request, runs[load.worker_id])
            weight = config.prefill_weight + config.queue_weight * load.num_queued_requests
            balance = config.balance_weight * (recent_work.get(load.worker_id, 0.0) - least_recent_work)
            costs[load.worker_id] = self.queued_tokens(load) + weight * work + balance + config.decode_weight * load.decode_load
        worker = self._pick(costs, prefill, request.num_prompt_tokens)
        if config.memory_s:
            self.index.remember(worker, found.suffix(runs[worker].blocks), self.clock() + config.memory_s)
        return Decision(worker, decode_id, runs[worker], costs[worker])

    def work_tokens(self, request: RouteRequest, run: CachedRun) -> float:
        """Prefill time of the prompt on a worker holding ``run``, in tokens of compute."""
        block = request.block_size
        computed = max(0, request.num_prompt_tokens - run.blocks * block)
        return computed + block * (run.cpu * self._cpu_cost + run.redis * self._redis_cost)

    def report(self, load: WorkerLoad) -> None:
        """The work sent to the worker before this report moves from the queue term (the report
        includes it) to the recent-work average; remembered decisions past ``memory_s`` go
        (here, off the request's path)."""
        sent = self._sent.get(load.worker_id)
        if sent is not None:
            recent_work = self._decayed_recent_work()
            recent_work[load.worker_id] = recent_work.get(load.worker_id, 0.0) + sent[0]
        self.index.forget_expired(self.clock())
        super().report(load)

    def _expire_if_late(self) -> None:
        """Without load reports (a router with one prefill worker, a test) expire here instead."""
        oldest = self.index.oldest_remembered_s()
        if oldest is not None and oldest + self.config.memory_s <= self.clock():
            self.index.forget_expired(self.clock())

    def _decayed_recent_work(self) -> dict[str, float]:
        now = self.clock()
        if now > self._recent_work_at:
            factor = math.exp(-(now - self._recent_work_at) / self.config.balance_window_s)
            for name in self._recent_work:
                self._recent_work[name] *= factor
            self._recent_work_at = now
        return self._recent_work

    def _pick(self, costs: dict[str, float], prefill: list[WorkerLoad], tokens: int) -> str:
        if self.config.temperature > 0:
            scale = self.config.temperature * max(1, tokens)
            best = min(costs.values())
            weights = [math.exp(-(costs[w.worker_id] - best) / scale) for w in prefill]
            return self._rng.choices([w.worker_id for w in prefill], weights)[0]
        best = min(costs.values())
        tied = [w for w in prefill if costs[w.worker_id] - best <= 1e-9]
        if len(tied) == 1:
            return tied[0].worker_id
        lowest = min(self.queued_tokens(w) for w in tied)
        tied = sorted(w.worker_id for w in tied if self.queued_tokens(w) == lowest)
        return tied[next(self._counter) % len(tied)]


def make_policy(name: str, index: PrefixIndex, config: PolicyConfig = PolicyConfig(), clock=time.monotonic) -> RoutingPolicy:
    """A policy by name (one of POLICIES)."""
    if name == "splitserve":
        return SplitservePolicy(index, config, clock)
    classes = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "sglang_cache_aware": SGLangCacheAware}
    if name not in classes:
        raise ValueError(f"policy: {name!r} is not one of {POLICIES}")
    return classes[name](index, clock)
