"""The simulated cluster behind bench.routing: prefill workers, their KV tiers, and the replay loop.

Each request of a trace (bench/traces.py) is routed by the real policy (router/routing/policy.py) over
the real ``PrefixIndex``, fed only by the KV events the simulated workers publish through real
``KVEventLog`` objects (``event_delay_s`` late, each batch the net change since the last); loads
reach the policy every ``report_interval_s``. Time is simulated, the policy's clock too; only
``decide_us`` is wall-clock.

A prefill worker computes its FIFO queue one prompt at a time at ``prefill_tokens_per_s``, plus
each cached block's load time from its fastest tier (the pool, its CPU tier, the cluster's one
Redis); then the prompt's full blocks enter the pool. Each tier is an LRU that spills its victims
to the next; a Redis victim leaves every worker that wrote it at once. TTFT is arrival to prefill
completion (no KV hand-off). The first token holds one of the chosen decode worker's slots for
``output_length / decode_tokens_per_s``; decode never delays a prefill.

Defaults: Llama-3-70B in FP8 on H100 SXM, a prefill replica on 2 GPUs (TP=2), 164,160 B of KV a
token: a 450k-token pool (the 74 GB left of 2 x 80 GiB after weights and activations), a 1.6M CPU
tier (half of a quarter of an HGX node's 2 TiB), 1 TiB of Redis cluster-wide (6.7M), prefill at
40% MFU of FP8 dense (10k tokens/s), CPU-tier loads over PCIe Gen5 (300k tokens/s), Redis loads
at ~5 GB/s a replica (30k tokens/s), and 8 decode workers of 256 sequences at 30 tokens/s.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from bench.report import percentile
from bench.traces import BLOCK_TOKENS, TraceRequest
from kv_store.events import EventKind, KVEventBatch, KVEventLog, Tier
from router.routing.policy import PolicyConfig, RouteRequest, WorkerLoad, make_policy
from router.routing.prefix_index import CachedRun, PrefixIndex


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster (sizes in tokens, speeds in tokens per second)."""

    num_workers: int = 8
    """Prefill workers."""
    pool_tokens: int = 450_000
    """KV pool of one prefill worker (GPU memory)."""
    cpu_tokens: int = 1_600_000
    """CPU tier of one prefill worker (0: none, pool evictions go to Redis)."""
    redis_tokens: int = 6_700_000
    """The Redis tier the whole cluster shares (0: none)."""
    prefill_tokens_per_s: float = 10_000.0
    """Prompt tokens one worker computes per second."""
    cpu_load_tokens_per_s: float = 300_000.0
    """Cached tokens one worker loads from its CPU tier per second."""
    redis_load_tokens_per_s: float = 30_000.0
    """Cached tokens one worker loads from Redis per second."""
    event_delay_s: float = 0.010
    """From a cache change on a worker to its KV event in the router's index."""
    report_interval_s: float = 0.050
    """Between two load reports of every worker."""
    num_decode_workers: int = 8
    """Decode workers (they hold sequences; they never delay a prefill)."""
    decode_slots: int = 256
    """Sequences one decode worker runs at once."""
    decode_tokens_per_s: float = 30.0
    """Tokens per second of one decoding sequence."""

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_decode_workers < 1 or self.decode_slots < 1:
            raise ValueError("num_workers, num_decode_workers and decode_slots: must be >= 1")
        if self.pool_tokens < BLOCK_TOKENS:
            raise ValueError(f"pool_tokens: must hold one {BLOCK_TOKENS}-token block, got {self.pool_tokens}")
        if min(self.cpu_tokens, self.redis_tokens, self.event_delay_s) < 0:
            raise ValueError("cpu_tokens, redis_tokens and event_delay_s: must be >= 0")
        for name in ("report_interval_s", "prefill_tokens_per_s", "cpu_load_tokens_per_s", "redis_load_tokens_per_s", "decode_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


class _TierChanges:
    """Net change of each tier's key set since the last batch (insertion-ordered)."""

    def __init__(self) -> None:
        self.stored: dict[Tier, dict[int, None]] = {t: {} for t in Tier}
        self.removed: dict[Tier, dict[int, None]] = {t: {} for t in Tier}

    def store(self, tier: Tier, key: int) -> None:
        removed = self.removed[tier]
        if key in removed:
            del removed[key]
        else:
            self.stored[tier][key] = None

    def remove(self, tier: Tier, key: int) -> None:
        stored = self.stored[tier]
        if key in stored:
            del stored[key]
        else:
            self.removed[tier][key] = None

    def seal(self, log: KVEventLog) -> KVEventBatch | None:
        for tier in Tier:
            log.record(EventKind.REMOVED, tier, self.removed[tier])
            log.record(EventKind.STORED, tier, self.stored[tier])
            self.removed[tier].clear()
            self.stored[tier].clear()
        return log.flush()


class SharedRedis:
    """The cluster's Redis tier: one LRU of keys, each with the set of workers that wrote it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.keys: OrderedDict[int, set[SimWorker]] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def write(self, worker: SimWorker, key: int) -> None:
        """``worker`` spills ``key``; like the real tier, it skips keys it wrote before."""
        if not self.num_blocks:
            return
        writers = self.keys.setdefault(key, set())
        if worker in writers:
            return
        writers.add(worker)
        self.keys.move_to_end(key)
        worker.changes.store(Tier.REDIS, key)
        while len(self.keys) > self.num_blocks:
            old, old_writers = self.keys.popitem(last=False)
            for w in old_writers:
                w.changes.remove(Tier.REDIS, old)


@dataclass
class _Job:
    request_index: int
    arrival_s: float
    keys: tuple[int, ...]
    num_tokens: int
    work_tokens: int
    """Uncached tokens: estimated when queued, exact from the start."""
    decode_id: str | None
    start_s: float = 0.0
    end_s: float = 0.0


class SimWorker:
    """A prefill worker: FIFO queue, pool and CPU tier as LRUs of block keys, a real event log."""

    def __init__(self, worker_id: str, config: ClusterConfig, redis: SharedRedis, retain_batches: int = 1) -> None:
        self.worker_id = worker_id
        self.redis = redis
        self.pool: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.num_pool_blocks = config.pool_tokens // BLOCK_TOKENS
        self.num_cpu_blocks = config.cpu_tokens // BLOCK_TOKENS
        self.log = KVEventLog(worker_id, retain=retain_batches)
        self.changes = _TierChanges()
        self.queue: deque[_Job] = deque()
        self.queued_tokens = 0
        self.running: _Job | None = None
        self.num_computed_tokens = 0

    def cached_run(self, keys: Sequence[int], touch: bool = False) -> CachedRun:
        """The longest run of ``keys`` from the first that this worker can serve, by tier."""
        counts = [0, 0, 0]
        for key in keys:
            if key in self.pool:
                tier, lru = 0, self.pool
            elif key in self.cpu:
                tier, lru = 1, self.cpu
            elif key in self.redis:
                tier, lru = 2, self.redis.keys
            else:
                break
            counts[tier] += 1
            if touch:
                lru.move_to_end(key)
        return CachedRun(*counts)

    def insert(self, keys: Sequence[int]) -> None:
        """A prefill finished: its full blocks become the pool's most recently used. The pool's
        victims go to the CPU tier (or straight to Redis without one), the CPU tier's to Redis."""
        for key in keys:
            victim = self._put(self.pool, Tier.POOL, self.num_pool_blocks, key)
            if victim is not None and self.num_cpu_blocks:
                victim = self._put(self.cpu, Tier.CPU, self.num_cpu_blocks, victim)
            if victim is not None:
                self.redis.write(self, victim)

    def _put(self, lru: OrderedDict[int, None], tier: Tier, num_blocks: int, key: int) -> int | None:
        """``key`` becomes the most recently used of ``lru``; returns the key it pushed out, if any."""
        if key in lru:
            lru.move_to_end(key)
            return None
        lru[key] = None
        self.changes.store(tier, key)
        if len(lru) <= num_blocks:
            return None
        old, _ = lru.popitem(last=False)
        self.changes.remove(tier, old)
        return old

    def load(self, now_s: float) -> WorkerLoad:
        tokens, running = self.queued_tokens, self.running
        if running is not None and running.end_s > running.start_s:
            tokens += running.work_tokens * (running.end_s - now_s) / (running.end_s - running.start_s)
        return WorkerLoad(self.worker_id, int(tokens), len(self.queue) + (running is not None))


class _DecodeWorker:
    def __init__(self, worker_id: str, num_slots: int) -> None:
        self.worker_id = worker_id
        self.num_slots = num_slots
        self.ends: list[float] = []
        self.peak = 0

    def start(self, now_s: float, duration_s: float) -> None:
        self._expire(now_s)
        heapq.heappush(self.ends, now_s + duration_s)
        self.peak = max(self.peak, len(self.ends))

    def load(self, now_s: float) -> WorkerLoad:
        self._expire(now_s)
        return WorkerLoad(self.worker_id, decode_load=len(self.ends) / self.num_slots)

    def _expire(self, now_s: float) -> None:
        while self.ends and self.ends[0] <= now_s:
            heapq.heappop(self.ends)


class Replay:
    """One policy over one trace. ``run()`` returns the policy's numbers; requests that arrive in
    the first ``warmup_s`` of the trace are simulated but not counted. Each worker's event log
    keeps its last ``retain_batches`` batches (tests replay them)."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: str,
        config: ClusterConfig = ClusterConfig(),
        policy_config: PolicyConfig = PolicyConfig(),
        warmup_s: float = 0.0,
        retain_batches: int = 1,
    ) -> None:
        self.trace = trace
        self.warmup_ms = (trace[0].timestamp_ms if trace else 0) + warmup_s * 1000
        self.config = config
        self.now_s = 0.0
        self.index = PrefixIndex()
        self.policy = make_policy(policy, self.index, policy_config, clock=lambda: self.now_s)
        self.redis = SharedRedis(config.redis_tokens // BLOCK_TOKENS)
        self.workers = [SimWorker(f"prefill-{i}", config, self.redis, retain_batches) for i in range(config.num_workers)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.decoders = {f"decode-{i}": _DecodeWorker(f"decode-{i}", config.decode_slots) for i in range(config.num_decode_workers)}
        for worker in self.workers:
            self.index.add_worker(worker.worker_id)
        self._completions: list[tuple[float, int, SimWorker]] = []
        self._deliveries: deque[tuple[float, KVEventBatch]] = deque()
        self._next_report_s = trace[0].timestamp_ms / 1000 if trace else 0.0
        self._reports_on = True
        self._loads = [w.load(0.0) for w in self.workers]
        self._decode_loads = [d.load(0.0) for d in self.decoders.values()]
        n = len(trace)
        self.ttft_s = [0.0] * n
        self.decide_us = [0.0] * n
        self.cached = [CachedRun()] * n
        self.busy_s = [0.0] * n

    def run(self) -> dict:
        for i, request in enumerate(self.trace):
            now = request.timestamp_ms / 1000
            self._advance(now)
            self.now_s = now
            keys = request.block_keys()
            route = RouteRequest(f"r{i}", keys, request.input_length, BLOCK_TOKENS)
            start = time.perf_counter_ns()
            decision = self.policy.choose(route, self._loads, self._decode_loads)
            self.decide_us[i] = (time.perf_counter_ns() - start) / 1000
            if decision.prefill is None:
                raise ValueError("the replay routes prefill only: a policy that leaves prefill to the decode worker is not supported")
            worker = self.by_id[decision.prefill]
            work = request.input_length - worker.cached_run(keys).blocks * BLOCK_TOKENS
            worker.queue.append(_Job(i, now, keys, request.input_length, work, decision.decode))
            worker.queued_tokens += work
            if worker.running is None:
                self._start_next(worker, now)
        self._reports_on = False
        self._advance(math.inf)
        return self._result()

    def _advance(self, until_s: float) -> None:
        """Run completions, event deliveries and load reports up to ``until_s``, in time order."""
        while True:
            t_done = self._completions[0][0] if self._completions else math.inf
            t_event = self._deliveries[0][0] if self._deliveries else math.inf
            t_report = self._next_report_s if self._reports_on else math.inf
            now = min(t_done, t_event, t_report)
            if now > until_s or now == math.inf:
                return
            self.now_s = now
            if t_done == now:
                self._complete(heapq.heappop(self._completions)[2], now)
            elif t_event == now:
                self.index.apply(self._deliveries.popleft()[1])
            else:
                self._loads = [w.load(now) for w in self.workers]
                self._decode_loads = [d.load(now) for d in self.decoders.values()]
                for load in self._loads:
                    self.policy.report(load)
                self._next_report_s = now + self.config.report_interval_s

    def _start_next(self, worker: SimWorker, now: float) -> None:
        job = worker.queue.popleft()
        worker.queued_tokens -= job.work_tokens
        run = worker.cached_run(job.keys, touch=True)
        self.cached[job.request_index] = run
        config = self.config
        job.work_tokens = job.num_tokens - run.blocks * BLOCK_TOKENS
        duration = job.work_tokens / config.prefill_tokens_per_s + run.cpu * BLOCK_TOKENS / config.cpu_load_tokens_per_s + run.redis * BLOCK_TOKENS / config.redis_load_tokens_per_s
        job.start_s, job.end_s = now, now + duration
        self.busy_s[job.request_index] = duration
        worker.running = job
        heapq.heappush(self._completions, (job.end_s, job.request_index, worker))

    def _complete(self, worker: SimWorker, now: float) -> None:
        job = worker.running
        worker.running = None
        if self.trace[job.request_index].timestamp_ms >= self.warmup_ms:
            worker.num_computed_tokens += job.work_tokens
        self.ttft_s[job.request_index] = now - job.arrival_s
        worker.insert(job.keys)
        if job.decode_id is not None:
            output = self.trace[job.request_index].output_length
            self.decoders[job.decode_id].start(now, output / self.config.decode_tokens_per_s)
        for w in self.workers:
            batch = w.changes.seal(w.log)
            if batch is not None:
                self._deliveries.append((now + self.config.event_delay_s, batch))
        if worker.queue:
            self._start_next(worker, now)

    def _result(self) -> dict:
        measured = [i for i, r in enumerate(self.trace) if r.timestamp_ms >= self.warmup_ms]
        if not measured:
            raise ValueError("no request arrives after the warm-up")
        num_prompt_tokens = sum(self.trace[i].input_length for i in measured) or 1
        tiers = {tier: sum(getattr(self.cached[i], tier) for i in measured) * BLOCK_TOKENS / num_prompt_tokens for tier in ("pool", "cpu", "redis")}
        computed = [w.num_computed_tokens for w in self.workers]
        ttft_s = [self.ttft_s[i] for i in measured]
        decide_us = [self.decide_us[i] for i in measured]
        long_decides = [self.decide_us[i] for i in measured if self.trace[i].input_length >= 32768]
        span_s = max(1e-9, (self.trace[measured[-1]].timestamp_ms - self.trace[measured[0]].timestamp_ms) / 1000)
        return {
            "num_requests": len(measured),
            "hit_ratio": sum(tiers.values()),
            "hit_ratio_pool": tiers["pool"],
            "hit_ratio_cpu": tiers["cpu"],
            "hit_ratio_redis": tiers["redis"],
            "load_max_over_mean": max(computed) / (sum(computed) / len(computed)) if sum(computed) else 1.0,
            "prefill_tokens_computed": computed,
            "prefill_busy_share": sum(self.busy_s[i] for i in measured) / (len(self.workers) * span_s),
            "ttft_s_p50": percentile(ttft_s, 50),
            "ttft_s_p90": percentile(ttft_s, 90),
            "ttft_s_p99": percentile(ttft_s, 99),
            "ttft_s_mean": sum(ttft_s) / len(ttft_s),
            "decide_us_p50": percentile(decide_us, 50),
            "decide_us_p99": percentile(decide_us, 99),
            "decide_us_p99_32k": percentile(long_decides, 99) if long_decides else None,
            "num_requests_32k": len(long_decides),
            "decode_slots_peak": max(d.peak for d in self.decoders.values()),
        }


def oracle_hit_ratio(trace: Sequence[TraceRequest], warmup_s: float = 0.0) -> float:
    """Share of prompt tokens an infinite single cache would serve: each prompt's leading full
    blocks whose ids an earlier request had (with chained ids that is every seen id). Requests
    before ``warmup_s`` fill the cache but are not counted."""
    seen: set[int] = set()
    hit = total = 0
    counted_from_ms = (trace[0].timestamp_ms if trace else 0) + warmup_s * 1000
    for request in trace:
        keys = request.block_keys()
        if request.timestamp_ms >= counted_from_ms:
            run = 0
            while run < len(keys) and keys[run] in seen:
                run += 1
            hit += run * BLOCK_TOKENS
            total += request.input_length
        seen.update(keys)
    return hit / total if total else 0.0
