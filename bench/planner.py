"""Trace replay of the SLA planner: the real SLAPlanner against a static split and an HPA rule.

    python -m bench.planner --trace FILE [--generate bursty] --json OUT --plot OUT.png

A trace is an Azure LLM 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or, ending in
``.jsonl``, a Mooncake trace. With ``--generate bursty`` a seeded trace is written to FILE first:
Poisson arrivals on a base rate with smooth bursts of long prompts, of long outputs, of both, and
quiet spells. The replay is a discrete-event simulation of the two pools whose costs come from
the perf model (planner/perf_model.py; default the Splitwise llama2-70b H100 TP 4 rows):

- prefill: each prompt goes to the ready prefill replica that frees up first and takes
  ``prefill_s(prompt)``; with no ready prefill replica the decode replica prefills it itself,
  stalling its whole batch (conditional disaggregation, the prefill pool at zero);
- decode: each request joins the ready decode replica with the smallest batch, and every
  sequence on a replica advances one token per ``itl_s(batch)``;
- a replica asked for is ready ``--startup-s`` later (default 60) and costs from the moment it is asked for;
  one removed drains (takes nothing new, finishes what it has) and costs until it is empty.

Every ``interval_s`` the policy sees the interval's Observation and the pools and sets targets.
A request meets the SLO when its TTFT and its mean ITL both do; KV transfer time is not modelled.
``oracle`` is the planner told the coming load: its gap to ``splitserve`` is forecast error. ``hindsight``
(bench/hindsight.py) is the cheapest prefill schedule chosen knowing the whole trace: what the trace allows.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import heapq
import math
import random
import sys
from collections import deque
from pathlib import Path
from typing import NamedTuple

from bench.hindsight import ArrivingLoad, replay_hindsight
from bench.report import BenchError, arg_parser, emit_report, machine, percentile, progress, run
from bench.traces import read_trace as read_mooncake
from planner.config import PlannerConfig
from planner.connector import POOLS, PoolReplicas
from planner.perf_model import PerfModel, load_profile, load_splitwise_csv
from planner.policy import Observation, SLAPlanner
from router.cli_args import add_dataclass_args, dataclass_from_args

CSV_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
DEFAULT_PERF = Path(__file__).resolve().parents[1] / "planner" / "data" / "splitwise_perf_model.csv"
HPA_TARGET = 0.7
"""HPA's utilisation target: prefill busy share, decode batch as a share of the batch at the ITL SLO."""


class Arrival(NamedTuple):
    time_s: float
    prompt_tokens: int
    output_tokens: int


def read_arrivals(path: Path) -> list[Arrival]:
    """The trace at ``path`` from time 0, or a BenchError naming the first bad line."""
    if not path.is_file():
        raise BenchError(f"--trace {path}: no such file")
    if path.suffix in (".jsonl", ".json"):
        try:
            rows = [(r.timestamp_ms / 1000, r.input_length, r.output_length) for r in read_mooncake(path)]
        except ValueError as e:
            raise BenchError(f"--trace {path}: {e}") from None
    else:
        rows = []
        with open(path, newline="") as f:
            reader = csv.reader(f)
            if next(reader, None) != CSV_HEADER:
                raise BenchError(f"--trace {path}: line 1 is not the header {','.join(CSV_HEADER)}")
            for row in reader:
                try:
                    if row:
                        stamp, prompt, output = row
                        rows.append((_seconds(stamp), int(prompt), int(output)))
                        if rows[-1][1] < 1 or rows[-1][2] < 0:
                            raise ValueError
                except ValueError:
                    raise BenchError(f"--trace {path}: line {reader.line_num} is not TIMESTAMP,ContextTokens,GeneratedTokens: {','.join(row)!r}") from None
    if len(rows) < 2:
        raise BenchError(f"--trace {path}: fewer than two requests")
    rows.sort()
    start = rows[0][0]
    return [Arrival(t - start, p, max(1, o)) for t, p, o in rows]


def _seconds(stamp: str) -> float:
    try:
        return float(stamp)
    except ValueError:
        return datetime.datetime.fromisoformat(stamp).timestamp()


def generate_bursty(seed: int, duration_s: float = 3600.0, base_rate: float = 10.0) -> list[Arrival]:
    """Poisson arrivals at ``base_rate`` with Gaussian-shaped bursts (sigma 90-240 s) of long prompts
    (x4), long outputs (x4), triple rate, or a quiet spell (5% of the rate), one kind at a time."""
    rng = random.Random(seed)
    bursts, t = [], 300.0
    while t < duration_s - 300:
        width = rng.uniform(90, 240)
        bursts.append((t + 2 * width, width, rng.choice(("prompt", "output", "both", "quiet"))))
        t += 4 * width + rng.uniform(60, 300)

    def shape(now: float) -> tuple[float, float, float]:
        rate, prompt, output = 1.0, 1.0, 1.0
        for center, width, kind in bursts:
            bump = math.exp(-(((now - center) / width) ** 2) / 2)
            rate *= {"prompt": 1 + bump, "output": 1 + bump, "both": 1 + 2 * bump, "quiet": 1 - 0.95 * bump}[kind]
            prompt += 3 * bump if kind == "prompt" else 0.0
            output += 3 * bump if kind == "output" else 0.0
        return rate, prompt, output

    out, now = [], 0.0
    while True:
        now += rng.expovariate(3 * base_rate)
        if now >= duration_s:
            return out
        rate, prompt, output = shape(now)
        if rng.random() < rate / 3:
            prompt_tokens = int(min(16000, max(16, rng.lognormvariate(math.log(700), 1.0) * prompt)))
            out.append(Arrival(now, prompt_tokens, int(min(4000, max(1, rng.lognormvariate(math.log(150), 0.8) * output)))))


def write_csv(trace: list[Arrival], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    base = datetime.datetime(2024, 1, 1)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for a in trace:
            writer.writerow([(base + datetime.timedelta(seconds=a.time_s)).isoformat(sep=" "), a.prompt_tokens, a.output_tokens])


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
        self.events, self.seq, self.pending = [], 0, []
        self.replicas = {pool: [_Replica(pool, 0.0, 0.0) for _ in range(n)] for pool, n in zip(POOLS, initial)}
        n = len(trace)
        self.first_s, self.start_s, self.finish_s = [math.nan] * n, [math.nan] * n, [math.nan] * n
        self.first_tokens, self.itls, self.timeline, self.decisions = [], [], [], []
        self.batch_at_slo = max(1, perf.largest_batch(config.itl_slo_s, config.max_decode_batch))

    def _push(self, t, kind, x) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, x))

    def run(self) -> dict:
        for i, a in enumerate(self.trace):
            self._push(a.time_s, 3, i)
        self._push(self.config.interval_s, 4, None)
        arrived = [0, 0, 0]
        while self.events:
            now, _, kind, x = heapq.heappop(self.events)
            if kind == 0 and not x.removed and x.pool == "decode":
                for i in self.pending:
                    self._join(x, i, now, now)
                self.pending.clear()
            elif kind == 1:
                replica = self._decode_replica(now)
                self.pending.append(x) if replica is None else self._join(replica, x, now, now)
            elif kind == 2 and x[1] == x[0].version:
                self._finish(x[0], now)
            elif kind == 3:
                a = self.trace[x]
                arrived = [arrived[0] + 1, arrived[1] + a.prompt_tokens, arrived[2] + a.output_tokens]
                self._arrive(x, now)
            elif kind == 4:
                self._tick(now, arrived)
                arrived = [0, 0, 0]
        return self._result()

    def _ready(self, pool, now):
        return [r for r in self.replicas[pool] if not r.removed and r.ready_s <= now]

    def _decode_replica(self, now):
        ready = self._ready("decode", now)
        return min(ready, key=lambda r: len(r.heap)) if ready else None

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
            r.tokens += running_s / (self.cost * self.perf.itl_s(len(r.heap)))
        r.batch_s += len(r.heap) * max(0.0, now - r.last_s)
        r.last_s = max(r.last_s, now)

    def _join(self, r: _Replica, i: int, now: float, start_s: float) -> None:
        self._advance(r, now)
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

    def _pools(self, now) -> dict[str, PoolReplicas]:
        out = {}
        for pool, replicas in self.replicas.items():
            kept = [r for r in replicas if not r.removed]
            ready = sum(r.ready_s <= now for r in kept)
            out[pool] = PoolReplicas(pool, len(kept), ready, len(kept) - ready, sum(r.removed and (r.end_s is None or r.end_s > now) for r in replicas))
        return out

    def _tick(self, now: float, arrived: list[int]) -> None:
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
        obs = Observation(now, interval, arrived[0], arrived[1], arrived[2], mean(ttfts), p90(ttfts), mean(itls), p90(itls), int(queued), kv)
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

    def _result(self) -> dict:
        config, trace = self.config, self.trace
        ttft = [f - a.time_s for f, a in zip(self.first_s, trace)]
        itl = [(f - s) / a.output_tokens for f, s, a in zip(self.finish_s, self.start_s, trace)]
        assert not any(math.isnan(x) for x in ttft + itl), "every request is served by the end"
        met = sum(t <= config.ttft_slo_s and i <= config.itl_slo_s for t, i in zip(ttft, itl))
        hours = {p: sum(min(r.end_s if r.end_s is not None else self.end_s, self.end_s) - min(r.alloc_s, self.end_s) for r in rs) / 3600 for p, rs in self.replicas.items()}
        steps = [[b[c] - a[c] for a, b in zip(self.timeline, self.timeline[1:]) if b[c] != a[c]] for c in (2, 3)]  # per pool
        changes = sum((x > 0) != (y > 0) for pool in steps for x, y in zip(pool, pool[1:]))
        return {
            "slo_attainment": met / len(trace),
            "replica_hours": hours["prefill"] + hours["decode"],
            "prefill_replica_hours": hours["prefill"],
            "decode_replica_hours": hours["decode"],
            "direction_changes": changes,
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


def warm_start(trace, perf, config) -> tuple[int, int]:
    """(prefill, decode) replicas the planner sizes for the trace's first interval, where the dynamic
    policies start, ready: traffic is already flowing when a trace starts, and the static split,
    sized for the whole trace, pays no cold start either."""
    first = [a for a in trace if a.time_s < config.interval_s]
    observation = Observation(config.interval_s, config.interval_s, len(first), sum(a.prompt_tokens for a in first), sum(a.output_tokens for a in first))
    pools = {pool: PoolReplicas(pool, 1, 1) for pool in POOLS}
    needed = SLAPlanner(config, perf).decide(observation, pools).needed
    return (min(config.max_prefill, max(config.min_prefill, needed["prefill"])), min(config.max_decode, max(config.min_decode, needed["decode"])))


def replay(trace, perf, config, policy, cost_scale=1.0, static=None) -> tuple[dict, list]:
    """``policy``'s result and timeline on ``trace`` (replicas start in ``config.startup_s``); ``static`` searches the cheapest
    split reaching ``config.attainment_target``; ``hindsight`` (bench/hindsight.py) starts from static's result, replayed unless given."""
    sim = lambda controller, initial: Simulation(trace, perf, config, controller, initial, cost_scale)  # noqa: E731
    if policy == "hindsight":
        return replay_hindsight(trace, perf, config, static or replay(trace, perf, config, "static", cost_scale)[0], sim, cost_scale)
    start = warm_start(trace, perf, config)
    if policy in ("splitserve", "oracle"):
        planner, infeasible, oracle = SLAPlanner(config, perf), [], ArrivingLoad(trace, config) if policy == "oracle" else None
        planner.predictor = oracle or planner.predictor

        def controller(now, observation, pools, use):
            if oracle is not None:
                oracle.now_s = now
            decision = planner.decide(observation, pools)
            infeasible.extend(decision.infeasible)
            return dict(decision.targets)

        s = sim(controller, start)
        result = s.run()
        result.update(infeasible_intervals=len(infeasible), final_corrections=planner.corrections)
        return result, s.timeline
    if policy == "hpa":
        s = sim(HPA(config), start)
        return s.run(), s.timeline
    target = config.attainment_target
    for total in range(1, config.max_prefill + config.max_decode + 1):
        tried = {}
        for prefill in range(0, min(total - 1, config.max_prefill) + 1):
            if total - prefill <= config.max_decode:
                s = sim(lambda *_: None, (prefill, total - prefill))
                tried[(prefill, total - prefill)] = (s.run(), s.timeline)
        best = max(tried, key=lambda k: tried[k][0]["slo_attainment"])
        if tried[best][0]["slo_attainment"] >= target:
            tried[best][0].update(split={"prefill": best[0], "decode": best[1]}, splits_tried=len(tried))
            return tried[best]
    raise BenchError(f"no static split up to max_prefill {config.max_prefill} and max_decode {config.max_decode} reaches attainment {target}")


def evaluate_goals(results: dict) -> dict:
    """The issue's targets for ``splitserve`` against ``static`` and ``hpa``, each with whether it is met."""
    ours, static, hpa = results.get("splitserve"), results.get("static"), results.get("hpa")
    if not (ours and static and hpa):
        return {}
    gap = static["slo_attainment"] - ours["slo_attainment"]
    hours = ours["replica_hours"] / static["replica_hours"]
    return {
        "attainment_within_0.01_of_static": {"target": f">= {static['slo_attainment'] - 0.01:.4f}", "value": ours["slo_attainment"], "met": gap <= 0.01},
        "replica_hours_over_static": {"target": "<= 0.8", "value": hours, "met": hours <= 0.8},
        "direction_changes_below_hpa": {"target": f"< {hpa['direction_changes']}", "value": ours["direction_changes"], "met": ours["direction_changes"] < hpa["direction_changes"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False, plot="arrival rate and each policy's replicas over time")
    parser.add_argument("--trace", type=Path, required=True, help="Azure LLM 2023 CSV or Mooncake JSONL (with --generate: written first, as CSV)")
    parser.add_argument("--generate", choices=("bursty",), help="write a seeded bursty trace to --trace, then replay it")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace (default: 0)")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="length of a generated trace (default: 3600)")
    parser.add_argument("--perf-model", type=Path, default=DEFAULT_PERF, help="Splitwise CSV or profile JSON (default: planner/data/splitwise_perf_model.csv)")
    parser.add_argument("--perf-rows", nargs=3, default=["llama2-70b", "h100-80gb", "4"], metavar=("MODEL", "HARDWARE", "TP"), help="Splitwise row set (default: llama2-70b h100-80gb 4)")
    parser.add_argument("--cost-scale", type=float, default=1.0, help="simulated costs over the perf model's (the planner's correction must find it; default: 1)")
    parser.add_argument("--policies", nargs="+", choices=("splitserve", "static", "hpa", "oracle", "hindsight"), default=["splitserve", "static", "hpa"], help="oracle: the planner told the coming load; hindsight: the cheapest prefill schedule knowing the whole trace (default: the first three)")
    add_dataclass_args(parser, PlannerConfig)
    args = parser.parse_args(argv)
    try:
        config = dataclass_from_args(PlannerConfig, args)
    except ValueError as e:
        parser.error(str(e))
    if args.cost_scale <= 0:
        parser.error("--cost-scale must be above 0")
    try:
        perf = load_profile(args.perf_model) if args.perf_model.suffix == ".json" else load_splitwise_csv(args.perf_model, args.perf_rows[0], args.perf_rows[1], int(args.perf_rows[2]))
    except (OSError, ValueError) as e:
        raise BenchError(f"--perf-model {args.perf_model}: {e}") from None
    if args.generate:
        progress("planner", f"generating a bursty trace of {args.duration_s:.0f} s (seed {args.seed}) into {args.trace}")
        write_csv(generate_bursty(args.seed, args.duration_s), args.trace)
    trace = read_arrivals(args.trace)
    results, timelines = {}, {}
    for name in sorted(args.policies, key=lambda name: name == "hindsight"):  # it starts from static's split
        progress("planner", f"{name}: replaying {len(trace)} requests over {trace[-1].time_s:.0f} s")
        results[name], timelines[name] = replay(trace, perf, config, name, args.cost_scale, results.get("static"))
        r = results[name]
        progress("planner", f"{name}: attainment {r['slo_attainment']:.4f}, {r['replica_hours']:.2f} replica-hours, {r['direction_changes']} direction changes")
    span_s = trace[-1].time_s
    report = {
        "trace": str(args.trace),
        "trace_stats": {"num_requests": len(trace), "span_s": span_s, "request_rate": len(trace) / span_s,
                        "prompt_tokens_mean": sum(a.prompt_tokens for a in trace) / len(trace), "output_tokens_mean": sum(a.output_tokens for a in trace) / len(trace)},
        "perf_model": perf.source,
        "cost_scale": args.cost_scale,
        "planner_config": dataclasses.asdict(config),
        "policies": results,
        "goals": evaluate_goals(results),
        "machine": machine(),
    }
    emit_report(report, args.json)
    if args.plot is not None:
        _plot(args.plot, f"bench.planner: {args.trace.name} ({perf.source})", timelines)
    return 0


def _plot(path: Path, title: str, timelines: dict[str, list]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    first = next(iter(timelines.values()))
    axes[0].plot([row[0] / 60 for row in first], [row[1] for row in first], color="black")
    axes[0].set_ylabel("arrivals (req/s)")
    for k, pool in enumerate(POOLS):
        for name, rows in timelines.items():
            axes[1 + k].step([row[0] / 60 for row in rows], [row[2 + k] for row in rows], where="post", label=name)
        axes[1 + k].set_ylabel(f"{pool} replicas")
        axes[1 + k].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run("planner", main))
