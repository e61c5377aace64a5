"""bench.planner's replay: a discrete-event simulation of the two pools, and the HPA rule it is compared with.

- prefill: each prompt goes to the ready prefill replica that frees up first and takes
  ``prefill_s(prompt)``; with no ready prefill replica the decode replica prefills it itself,
  stalling its whole batch (conditional disaggregation, the prefill pool at zero); the prompts it
  has not prefilled yet are its queue (queued prompt tokens, as the engine reports them), not
  running sequences;
- decode: each request joins the ready decode replica with the smallest batch among those whose KV
  (``kv_tokens`` a replica; a sequence holds its prompt and its whole answer) has room for it, and
  every sequence on a replica advances one token per ``itl_s(batch)``; a request no replica has
  room for waits, first come first served, and its wait counts in its ITL (the answer stalls after
  its first token); a replica with nothing running takes any request (a decode replica prefilling
  its own prompts, the prefill pool at zero, takes them whatever its KV);
- a replica asked for is ready ``startup_s`` later and costs from the moment it is asked for;
  one removed drains (takes nothing new, finishes what it has) and costs until it is empty.

Every ``interval_s`` the policy sees the interval's Observation and the pools and sets targets.
A request meets the SLO when its TTFT and its mean ITL both do; KV transfer time is not modelled.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque

from bench.report import percentile
from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.perf_model import PerfModel
from planner.observation import Observation
from router.frontend.metrics import PROMPT_LENGTH_BUCKETS

HPA_TARGET = 0.7
"""HPA's utilisation target: prefill busy share, decode batch as a share of the batch at the ITL SLO."""


class _Replica:
    """One simulated replica; prefill ones use ``free_s`` and ``work``, decode ones the fluid batch:
    every running sequence has made ``tokens`` progress, sequence i finishes when it reaches ``heap``'s key."""

    def __init__(self, pool: str, alloc_s: float, ready_s: float) -> None:
        self.pool, self.alloc_s, self.ready_s, self.end_s, self.removed = pool, alloc_s, ready_s, None, False
        self.free_s, self.work = ready_s, deque()  # prefill: (start_s, finish_s, tokens)
        self.tokens, self.last_s, self.stall_s, self.heap, self.version, self.batch_s, self.kv = 0.0, ready_s, 0.0, [], 0, 0.0, 0


class Simulation:
    """One replay of a trace under one policy (``controller(now, observation, pools, use)`` returns targets or None)."""

    def __init__(self, trace, perf: PerfModel, config: PlannerConfig, controller, initial: tuple[int, int], cost_scale: float = 1.0, kv_tokens: int = 480_000):
        self.trace, self.perf, self.config, self.controller = trace, perf, config, controller
        self.startup_s, self.cost, self.kv_tokens = config.startup_s, cost_scale, kv_tokens
        self.end_s = trace[-1].time_s
        self.events, self.seq, self.pending = [], 0, deque()  # pending: prefilled, waiting for a decode replica with room
        self.replicas = {pool: [_Replica(pool, 0.0, 0.0) for _ in range(n)] for pool, n in zip(POOLS, initial)}
        n = len(trace)
        self.first_s, self.start_s, self.finish_s = [math.nan] * n, [math.nan] * n, [math.nan] * n
        self.first_tokens, self.itls, self.timeline, self.decisions = [], [], [], []
        self.streamed = 0.0  # output tokens streamed so far, each answer's first and its decoded ones (what splitserve_output_tokens counts)
        self._streamed_at_tick = 0.0
        self.batch_at_slo = max(1, perf.largest_batch(config.itl_slo_s, config.max_decode_batch))

    def _push(self, t, kind, x) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, x))

    def run(self) -> dict:
        for i, a in enumerate(self.trace):
            self._push(a.time_s, 3, i)
        self._push(self.config.interval_s, 4, None)
        arrived, lengths = [0, 0, 0], []
        while self.events:
            now, _, kind, x = heapq.heappop(self.events)
            if kind == 0 and not x.removed and x.pool == "decode":
                self._admit(now)
            elif kind == 1:
                self.pending.append(x)
                self._admit(now)
            elif kind == 2 and x[1] == x[0].version:
                self._finish(x[0], now)
            elif kind == 3:
                a = self.trace[x]
                arrived = [arrived[0] + 1, arrived[1] + a.prompt_tokens, arrived[2] + a.output_tokens]
                lengths.append(a.prompt_tokens)
                self._arrive(x, now)
            elif kind == 4:
                self._tick(now, arrived, lengths)
                arrived, lengths = [0, 0, 0], []
        return self._result()

    def _ready(self, pool, now):
        return [r for r in self.replicas[pool] if not r.removed and r.ready_s <= now]

    def _decode_replica(self, now, kv_tokens: int | None = None):
        """The ready decode replica with the smallest batch, among those whose KV has room for
        ``kv_tokens`` more when that is given (one with nothing running always has), or None."""
        ready = [r for r in self._ready("decode", now) if kv_tokens is None or not r.heap or r.kv + kv_tokens <= self.kv_tokens]
        return min(ready, key=lambda r: len(r.heap)) if ready else None

    def _admit(self, now: float) -> None:
        """Prefilled requests join decode replicas in arrival order while the first has room on one."""
        while self.pending:
            i = self.pending[0]
            replica = self._decode_replica(now, self.trace[i].prompt_tokens + self.trace[i].output_tokens)
            if replica is None:
                return
            self.pending.popleft()
            self._join(replica, i, now, self.first_s[i])

    def _arrive(self, i, now) -> None:
        a, ready = self.trace[i], self._ready("prefill", now)
        service_s = self.cost * self.perf.prefill_s(a.prompt_tokens)
        if ready:
            replica = min(ready, key=lambda r: r.free_s)
            start = max(now, replica.free_s)
            replica.free_s = start + service_s
            replica.work.append((start, replica.free_s, a.prompt_tokens))
            self.first_s[i] = replica.free_s
            heapq.heappush(self.first_tokens, (replica.free_s, replica.free_s - a.time_s))
            self._push(replica.free_s, 1, i)
            return
        replica = self._decode_replica(now) or min(self.replicas["decode"], key=lambda r: r.ready_s)
        self._advance(replica, now)
        replica.stall_s = max(now, replica.stall_s, replica.ready_s) + service_s
        self.first_s[i] = replica.stall_s
        heapq.heappush(self.first_tokens, (replica.stall_s, replica.stall_s - a.time_s))
        self._join(replica, i, now, replica.stall_s)

    def _advance(self, r: _Replica, now: float) -> None:
        running_s = max(0.0, now - max(r.last_s, r.stall_s))
        if r.heap:
            steps = running_s / (self.cost * self.perf.itl_s(len(r.heap)))
            r.tokens += steps
            self.streamed += steps * len(r.heap)
        r.batch_s += len(r.heap) * max(0.0, now - r.last_s)
        r.last_s = max(r.last_s, now)

    def _join(self, r: _Replica, i: int, now: float, start_s: float) -> None:
        self._advance(r, now)
        self.streamed += 1  # the first token, out of the prefill; the trace's output tokens are decoded after it
        self.start_s[i] = start_s
        heapq.heappush(r.heap, (r.tokens + self.trace[i].output_tokens, i))
        r.kv += self.trace[i].prompt_tokens + self.trace[i].output_tokens
        self._schedule(r, now)

    def _schedule(self, r: _Replica, now: float) -> None:
        r.version += 1
        if r.heap:
            self._push(max(now, r.stall_s) + (r.heap[0][0] - r.tokens) * self.cost * self.perf.itl_s(len(r.heap)), 2, (r, r.version))
        elif r.removed and r.end_s is None:
            r.end_s = now

    def _finish(self, r: _Replica, now: float) -> None:
        self._advance(r, now)
        while r.heap and r.heap[0][0] <= r.tokens + 1e-6:
            _, i = heapq.heappop(r.heap)
            self.finish_s[i] = now
            r.kv -= self.trace[i].prompt_tokens + self.trace[i].output_tokens
            self.itls.append((now - self.start_s[i]) / self.trace[i].output_tokens)
        self._schedule(r, now)
        self._admit(now)

    def _pools(self, now) -> dict[str, PoolReplicas]:
        out = {}
        for pool, replicas in self.replicas.items():
            kept = [r for r in replicas if not r.removed]
            ready = sum(r.ready_s <= now for r in kept)
            out[pool] = PoolReplicas(pool, len(kept), ready, len(kept) - ready, sum(r.removed and (r.end_s is None or r.end_s > now) for r in replicas))
        return out

    def _tick(self, now: float, arrived: list[int], lengths: list[int]) -> None:
        interval = self.config.interval_s
        ttfts = []
        while self.first_tokens and self.first_tokens[0][0] <= now:
            ttfts.append(heapq.heappop(self.first_tokens)[1])
        itls, self.itls = [i for i in self.itls], []
        busy_s, queued = 0.0, 0.0
        for r in self.replicas["prefill"]:
            for start, finish, tokens in r.work:
                busy_s += max(0.0, min(finish, now) - max(start, now - interval))
                queued += tokens * min(1.0, (finish - now) / (finish - start)) if finish > now else 0.0
            while r.work and r.work[0][1] <= now:
                r.work.popleft()
        decode = self._ready("decode", now)
        for r in self.replicas["decode"]:
            self._advance(r, now)
        batch = sum(r.batch_s for r in decode) / max(1, len(decode)) / interval
        for r in self.replicas["decode"]:
            r.batch_s = 0.0
        pools = self._pools(now)
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        p90 = lambda xs: percentile(xs, 90) if xs else None  # noqa: E731
        kv = sum(r.kv for r in decode) / (len(decode) * self.kv_tokens) if decode else None
        histogram = [0] * len(PROMPT_LENGTH_BUCKETS)
        for n in lengths:
            histogram[bisect.bisect_left(PROMPT_LENGTH_BUCKETS, n)] += 1
        streamed, self._streamed_at_tick = self.streamed - self._streamed_at_tick, self.streamed
        # A decode replica prefilling its own prompts (the prefill pool at zero) holds the requests
        # it has not prefilled yet as a queue, as the engine's scheduler does: they are queued
        # prompt tokens, not running sequences.
        running, decode_queued = 0, 0.0
        for r in self.replicas["decode"]:
            for _, i in r.heap:
                if self.start_s[i] <= now:
                    running += 1
                else:
                    tokens = self.trace[i].prompt_tokens
                    decode_queued += tokens * min(1.0, (self.start_s[i] - now) / (self.cost * self.perf.prefill_s(tokens)))
        obs = Observation(now, interval, arrived[0], arrived[1], round(streamed), mean(ttfts), p90(ttfts), mean(itls), p90(itls), int(queued + decode_queued), kv,
                          tuple(zip(PROMPT_LENGTH_BUCKETS, histogram)), running, int(decode_queued),
                          sum(t > self.config.ttft_slo_s for t in ttfts) + sum(t > self.config.itl_slo_s for t in itls))
        use = {"prefill": busy_s / (max(1, pools["prefill"].ready) * interval), "decode": batch / self.batch_at_slo}
        targets = self.controller(now, obs, pools, use)
        for pool, target in (targets or {}).items():
            self._scale(pool, target, now)
        self.timeline.append((now, arrived[0] / interval, *(sum(not r.removed for r in self.replicas[p]) for p in POOLS)))
        if now + interval <= self.end_s:
            self._push(now + interval, 4, None)

    def _scale(self, pool: str, target: int, now: float) -> None:
        kept = [r for r in self.replicas[pool] if not r.removed]
        for _ in range(target - len(kept)):
            replica = _Replica(pool, now, now + self.startup_s)
            self.replicas[pool].append(replica)
            self._push(replica.ready_s, 0, replica)
        # Starting replicas go first (newest first), then the least loaded.
        load = (lambda r: r.free_s) if pool == "prefill" else (lambda r: len(r.heap))
        for r in sorted(kept, key=lambda r: (r.ready_s <= now, load(r) if r.ready_s <= now else -r.ready_s))[: max(0, len(kept) - target)]:
            r.removed = True
            if r.ready_s > now:
                r.end_s = now
            elif pool == "prefill":
                r.end_s = max(now, r.free_s)
            elif not r.heap:
                r.end_s = now

    def latencies(self) -> tuple[list[float], list[float]]:
        """Each request's TTFT and mean ITL, in the trace's order (after ``run``)."""
        ttft = [f - a.time_s for f, a in zip(self.first_s, self.trace)]
        itl = [(f - s) / a.output_tokens for f, s, a in zip(self.finish_s, self.start_s, self.trace)]
        assert not any(math.isnan(x) for x in ttft + itl), "every request is served by the end"
        return ttft, itl

    def within_slo(self, ttft: list[float], itl: list[float]) -> list[bool]:
        """Per request, whether its TTFT and its mean ITL (``latencies``) are both within their SLOs."""
        return [t <= self.config.ttft_slo_s and i <= self.config.itl_slo_s for t, i in zip(ttft, itl)]

    def _result(self) -> dict:
        trace = self.trace
        ttft, itl = self.latencies()
        met = sum(self.within_slo(ttft, itl))
        hours = {p: sum(min(r.end_s if r.end_s is not None else self.end_s, self.end_s) - min(r.alloc_s, self.end_s) for r in rs) / 3600 for p, rs in self.replicas.items()}
        turns = {p: _turns(self.timeline, 2 + k) for k, p in enumerate(POOLS)}
        return {
            "slo_attainment": met / len(trace),
            "replica_hours": hours["prefill"] + hours["decode"],
            "prefill_replica_hours": hours["prefill"],
            "decode_replica_hours": hours["decode"],
            "direction_changes": sum(len(t) for t in turns.values()),
            "direction_changes_per_pool": {p: len(t) for p, t in turns.items()},
            "direction_changes_busiest_hour": {p: _busiest_hour(t) for p, t in turns.items()},
            "ttft_s_p90": percentile(ttft, 90),
            "itl_s_p90": percentile(itl, 90),
            "max_replicas": {p: max(row[2 + k] for row in self.timeline) if self.timeline else len(self.replicas[p]) for k, p in enumerate(POOLS)},
        }


class HPA:
    """Kubernetes HPA per pool: ceil(ready * use / target) outside a 10% tolerance, growing at once,
    shrinking to the highest recommendation of the last 5 minutes."""

    def __init__(self, config: PlannerConfig, tolerance: float = 0.1, stabilisation_s: float = 300.0) -> None:
        self.config, self.tolerance, self.stabilisation_s = config, tolerance, stabilisation_s
        self.history = {pool: deque() for pool in POOLS}

    def __call__(self, now, observation, pools, use) -> dict[str, int]:
        targets = {}
        for pool in POOLS:
            current, ready = pools[pool].target, pools[pool].ready
            ratio = use[pool] / HPA_TARGET
            desired = current if ready == 0 or abs(ratio - 1) <= self.tolerance else math.ceil(ready * ratio)
            desired = max(1, min(self.config.max_prefill if pool == "prefill" else self.config.max_decode, desired))
            history = self.history[pool]
            history.append((now, desired))
            while history[0][0] < now - self.stabilisation_s:
                history.popleft()
            targets[pool] = desired if desired >= current else min(current, max(d for _, d in history))
        return targets


def _turns(timeline: list[tuple], column: int) -> list[float]:
    """The times ``column``'s count (a pool's replicas) changed direction in ``timeline``: a change
    up after one down, or down after one up."""
    steps = [(b[0], b[column] > a[column]) for a, b in zip(timeline, timeline[1:]) if b[column] != a[column]]
    return [t for (_, x), (t, y) in zip(steps, steps[1:]) if x != y]


def _busiest_hour(turns: list[float]) -> int:
    """The most of ``turns`` (times, in order) within any hour: what a mean over a long trace
    hides, a pool flapping for an hour."""
    most, first = 0, 0
    for last, t in enumerate(turns):
        while turns[first] <= t - 3600.0:
            first += 1
        most = max(most, last - first + 1)
    return most
