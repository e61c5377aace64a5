"""The serving path's cost: one workload through gRPC on a local cluster and on the engine in-process.

    python -m bench.e2e --json OUT

Every run but the open-loop ones is a closed loop of N concurrent requests (random prompt tokens, exact output lengths,
EOS ignored) over one engine configuration. The systems:

- ``engine_step``: ``LLMEngine.step()`` called in a loop that adds each next request between two
  steps. Requests always join at a step boundary, which no concurrent client can arrange: this
  is the engine's ceiling, not a serving peer.
- ``engine_loop``: the same engine behind ``EngineLoop`` (its own thread, as in a worker), fed by
  N asyncio clients in-process. This is the engine as a library, with arrivals as they come;
  everything between it and ``grpc`` is the serving path (gRPC, router, request plane).
- ``grpc``: a local Ray cluster (controller, one decode worker, one router) driven by N client
  threads through ``SplitServeClient``.
- ``grpc_disaggregated``: the same plus one prefill worker, the cores split between the two.
- ``engine_loop_open``, ``grpc_open`` and ``engine_loop_open_repeat`` (at concurrency 8): open
  loop. ``--open-requests`` requests arrive on one Poisson schedule at ``--open-load`` (0.6) of
  the request rate ``engine_loop`` sustained closed-loop, each sent at its time however many are
  in flight, and each is paired with the other system's request of the same index. In a closed
  loop the next request leaves when the last one ends, which is right after a step: a path a few
  ms slower misses the next step and waits a whole one (~95 ms at N = 8), in every round.
  Arrivals that do not follow the steps pay what the path costs on average. The load is below
  saturation because at the full closed-loop rate the queue grows through a run, and a slightly
  slower run adds tens of ms of queueing (measured: +22 ms between two in-process runs of one
  schedule). The repeat is that A/A control: the in-process loop against itself on the schedule.
  The three run in that order ``--open-rounds`` times (4): the gap between the systems moves
  from round to round by more than the goal (+17 and +4 ms in two rounds minutes apart), so the
  verdict's interval is taken over rounds, not only over the requests of all rounds pooled.

The first three run in alternation, ``--rounds`` times per concurrency, because this machine's
speed drifts by more than the cost being measured between runs minutes apart; each run gets
prompts of the same lengths that no earlier run cached. While one system runs, the others idle.
With ``--engine-cpus LIST`` the engine runs alone on those CPUs (in-process and in the worker) and everything
else on the rest, as on a node whose engine cores are not the serving stack's.
TTFT runs from handing the request over to its first token; inter-token latency is the gap
between two token-bearing responses, per token. For gRPC runs, each request's TTFT minus the
``worker_first_token_s`` its last response reports is the serving path's share of that TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.workload import BenchRequest, emit_report, percentile, random_workload
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig, WorkerProcessConfig
from engine.cpus import format_cpu_list, move_serving_threads, parse_cpu_list
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from engine.request import EngineRequest, RequestOutput, RequestTrace
from prefill_worker.config import PrefillWorkerConfig
from proto import splitserve_pb2 as pb
from router.client import SplitServeClient
from router.config import RouterConfig
from router.controller import ReplicaSpec
from router.launch import Cluster, ClusterConfig

NUM_SPECIAL_TOKENS = 32
GOAL_CONCURRENCY = 8
GOAL_THROUGHPUT_LOSS = 0.10
GOAL_TTFT_ADDED_MS = 5.0


@dataclass(frozen=True)
class EngineSteps:
    """The engine's step counters (EngineStats), or their change over a run."""

    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0
    cpu_s: float = 0.0

    def __sub__(self, other: EngineSteps) -> EngineSteps:
        return EngineSteps(self.steps - other.steps, self.tokens - other.tokens, self.step_s - other.step_s, self.cpu_s - other.cpu_s)

    def __add__(self, other: EngineSteps) -> EngineSteps:
        return EngineSteps(self.steps + other.steps, self.tokens + other.tokens, self.step_s + other.step_s, self.cpu_s + other.cpu_s)


def loop_steps(loop: EngineLoop) -> EngineSteps:
    s = loop.stats
    return EngineSteps(s.num_steps, s.num_step_tokens, s.step_s, s.step_cpu_s)


_STEP_COUNTERS = {
    "splitserve_engine_steps_total": "steps",
    "splitserve_engine_step_tokens_total": "tokens",
    "splitserve_engine_step_seconds_total": "step_s",
    "splitserve_engine_step_cpu_seconds_total": "cpu_s",
}


def scraped_steps(metrics_url: str) -> EngineSteps:
    """A worker's step counters, from its Prometheus endpoint (as an SRE would read them)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _STEP_COUNTERS:
                values[_STEP_COUNTERS[sample.name]] = sample.value
    missing = set(_STEP_COUNTERS.values()) - set(values)
    if missing:
        raise RuntimeError(f"{metrics_url} has no {', '.join(sorted(missing))} counter")
    return EngineSteps(int(values["steps"]), int(values["tokens"]), values["step_s"], values["cpu_s"])


def counted(steps: Callable[[], EngineSteps], run: Callable[[], Run]) -> Run:
    """``run()``, with the engine's step counters over it attached."""
    before = steps()
    result = run()
    result.engine = steps() - before
    return result


@dataclass
class Run:
    """One system's run of one workload: per-request samples, in seconds."""

    system: str
    concurrency: int
    round: int = 0
    wall_s: float = 0.0
    num_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    path_ttft_s: list[float] = field(default_factory=list)
    """gRPC only: client TTFT minus the worker's own time to first token."""
    ttft_s_by_index: dict[int, float] = field(default_factory=dict)
    """Open-loop runs: TTFT per request index, to pair two systems' runs of one schedule."""
    queue_s: list[float] = field(default_factory=list)
    """Per request, the engine's wait from the request reaching it to its first scheduled step."""
    stages_by_index: dict[int, dict[str, float]] = field(default_factory=dict)
    """Open-loop runs: per request index, where its TTFT went (``STAGES``), in seconds."""
    prefill_work_by_index: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Open-loop runs: per request index, the steps of its ``prefill`` stage and the tokens they computed."""
    engine: EngineSteps | None = None
    """What the engine's steps did during the run (``counted``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request(
        self,
        start: float,
        events: list[tuple[float, int]],
        worker_first_token_s: float | None = None,
        index: int | None = None,
        queue_s: float | None = None,
        stages: dict[str, float] | None = None,
        prefill_work: tuple[int, int] | None = None,
    ) -> None:
        with self._lock:
            if queue_s is not None:
                self.queue_s.append(queue_s)
            ttft = events[0][0] - start
            self.ttft_s.append(ttft)
            if index is not None:
                self.ttft_s_by_index[index] = ttft
                if stages is not None:
                    self.stages_by_index[index] = stages
                if prefill_work is not None:
                    self.prefill_work_by_index[index] = prefill_work
            for (t0, _), (t1, n) in zip(events, events[1:]):
                self.itl_s += [(t1 - t0) / n] * n
            self.num_tokens += sum(n for _, n in events)
            if worker_first_token_s is not None:
                self.path_ttft_s.append(ttft - worker_first_token_s)


STAGES = ("hops", "request_plane", "pickup", "wait", "prefill", "handback")
"""Where a request's TTFT goes, in order (they add up to it):

- ``hops``: client to the worker and the first token back, outside the worker's event loop (gRPC, router,
  request-plane TCP); in-process, nothing.
- ``request_plane``: the worker's event loop from reading the Submit frame to starting the request.
- ``pickup``: reaching the engine's owner to the engine thread taking it in (the rest of the step it was running).
- ``wait``: steps that ran without it. ``prefill``: the steps computing its prompt, to its first token sampled.
- ``handback``: the engine thread handing that token to the event loop, to the request's coroutine resuming with it.
"""


def trace_stages(trace: RequestTrace, resumed_s: float) -> dict[str, float]:
    """The engine-side stages of one request from its RequestTrace and when its coroutine got the first token."""
    return {
        "pickup": trace.admitted_s - trace.arrival_s,
        "wait": trace.first_scheduled_s - trace.admitted_s,
        "prefill": trace.first_token_s - trace.first_scheduled_s,
        "handback": resumed_s - trace.first_token_s,
    }


def timings_stages(timings: pb.Timings, ttft_s: float) -> dict[str, float]:
    """The stages of one gRPC request from the worker's Timings and the client's TTFT."""
    return {
        "hops": ttft_s - timings.worker_first_token_s - timings.request_plane_s,
        "request_plane": timings.request_plane_s,
        "pickup": timings.admitted_s,
        "wait": timings.queue_s - timings.admitted_s,
        "prefill": timings.first_step_end_s - timings.queue_s,
        "handback": timings.worker_first_token_s - timings.first_step_end_s,
    }


def run_engine_step(engine: LLMEngine, workload: list[BenchRequest], concurrency: int) -> Run:
    """The synchronous step loop (engine thread only)."""
    run = Run("engine_step", concurrency)
    queue = list(enumerate(workload))
    started: dict[str, float] = {}
    events: dict[str, list[tuple[float, int]]] = {}
    start = time.perf_counter()
    while queue or started:
        while queue and len(started) < concurrency:
            index, req = queue.pop(0)
            rid = f"step-{time.monotonic_ns()}-{index}"
            engine.add_request(rid, list(req.prompt_token_ids), _params(req))
            started[rid], events[rid] = time.perf_counter(), []
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                events[out.request_id].append((now, len(out.new_token_ids)))
            if out.finished:
                run.request(started.pop(out.request_id), events.pop(out.request_id))
    run.wall_s = time.perf_counter() - start
    return run


async def _stream(loop: EngineLoop, request_id: str, req: BenchRequest) -> tuple[float, list[tuple[float, int]], RequestOutput, float]:
    """One request through ``loop``: when it was handed over, (time, tokens) per output with
    tokens, its last output, and when (``time.monotonic``) its first token reached this coroutine."""
    t0 = time.perf_counter()
    request = EngineRequest(request_id, list(req.prompt_token_ids), None, _params(req), None)
    events, resumed_s = [], None
    async for out in loop.generate(request):
        if out.new_token_ids:
            if resumed_s is None:
                resumed_s = time.monotonic()
            events.append((time.perf_counter(), len(out.new_token_ids)))
    return t0, events, out, resumed_s


def run_engine_loop(loop: EngineLoop, workload: list[BenchRequest], concurrency: int) -> Run:
    """N asyncio clients on this thread, the engine on the loop's."""
    run = Run("engine_loop", concurrency)
    queue = list(enumerate(workload))

    async def client() -> None:
        while queue:
            index, req = queue.pop(0)
            t0, events, last, _ = await _stream(loop, f"loop-{time.monotonic_ns()}-{index}", req)
            run.request(t0, events, queue_s=last.queue_s)

    async def main() -> None:
        await asyncio.gather(*(client() for _ in range(concurrency)))

    start = time.perf_counter()
    asyncio.run(main())
    run.wall_s = time.perf_counter() - start
    return run


def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process at ``rate_per_s``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def run_engine_loop_open(loop: EngineLoop, workload: list[BenchRequest], arrivals: list[float], concurrency: int, system: str = "engine_loop_open") -> Run:
    """Each request submitted at its arrival time, however many are in flight."""
    run = Run(system, concurrency)

    async def one(index: int, req: BenchRequest, start: float) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[index] - time.perf_counter()))
        t0, events, last, resumed_s = await _stream(loop, f"open-{time.monotonic_ns()}-{index}", req)
        work = (last.trace.prefill_steps, last.trace.prefill_step_tokens)
        run.request(t0, events, index=index, queue_s=last.queue_s, stages=trace_stages(last.trace, resumed_s), prefill_work=work)

    async def main() -> None:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, req, start) for i, req in enumerate(workload)))

    start = time.perf_counter()
    asyncio.run(main())
    run.wall_s = time.perf_counter() - start
    return run


def run_grpc_open(client: SplitServeClient, workload: list[BenchRequest], arrivals: list[float], concurrency: int) -> Run:
    """Each request sent at its arrival time from its own thread."""
    run = Run("grpc_open", concurrency)

    def one(index: int, req: BenchRequest, start: float) -> None:
        time.sleep(max(0.0, start + arrivals[index] - time.perf_counter()))
        events, last = [], None
        t0 = time.perf_counter()
        for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True):
            if response.token_ids:
                events.append((time.perf_counter(), len(response.token_ids)))
            last = response
        ttft = events[0][0] - t0
        t = last.timings
        work = (t.prefill_steps, t.prefill_step_tokens)
        run.request(t0, events, t.worker_first_token_s, index=index, queue_s=t.queue_s, stages=timings_stages(t, ttft), prefill_work=work)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i, req, start)) for i, req in enumerate(workload)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    return run


def run_grpc(client: SplitServeClient, workload: list[BenchRequest], concurrency: int, system: str = "grpc") -> Run:
    run = Run(system, concurrency)
    queue = list(workload)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                req = queue.pop(0)
            events, last = [], None
            t0 = time.perf_counter()
            for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True):
                if response.token_ids:
                    events.append((time.perf_counter(), len(response.token_ids)))
                last = response
            run.request(t0, events, last.timings.worker_first_token_s, queue_s=last.timings.queue_s)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - start
    return run


def _params(req: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True)


def variant(workload: list[BenchRequest], tag: int) -> list[BenchRequest]:
    """The same lengths with new prompts: the first token becomes ``tag``, so every block key
    (each chains from the first block) differs from any other variant's."""
    return [replace(r, prompt_token_ids=(tag,) + r.prompt_token_ids[1:]) for r in workload]


def summarize(runs: list[Run]) -> dict:
    """Pooled statistics per (system, concurrency), the serving path's cost per round and pooled,
    disaggregated against aggregated, and whether the goal is met: at concurrency 8, at most 10%
    of throughput lost against ``engine_loop``, and at most 5 ms of TTFT. The TTFT is judged
    twice, and ``met`` needs both: ``serving_path_met``, the time spent on the serving path
    measured per request (client TTFT minus the worker's own), its p50 closed-loop and, where the
    open-loop runs are in, its mean open-loop; and ``end_to_end_met``, the TTFT added per request
    (mean of the paired differences) against the average of ``engine_loop_open`` and
    ``engine_loop_open_repeat`` (or ``engine_loop_open`` alone without the repeat; see
    ``_open_loop``). The second also holds what the serving stack takes from the engine itself,
    which the report measures apart (``engine_vs_bracket``), as it does the throughput."""
    groups: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.system, r.concurrency), []).append(r)
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    results = []
    for (system, c), group in groups.items():
        ttft = [v for r in group for v in r.ttft_s]
        itl = [v for r in group for v in r.itl_s]
        path = [v for r in group for v in r.path_ttft_s]
        row = {
            "system": system,
            "concurrency": c,
            "rounds": len(group),
            "output_tok_per_s": round(sum(r.num_tokens for r in group) / sum(r.wall_s for r in group), 2),
            "output_tok_per_s_by_round": [round(r.num_tokens / r.wall_s, 2) for r in group],
            "ttft_ms_p50": ms(percentile(ttft, 50)),
            "ttft_ms_p50_by_round": [ms(percentile(r.ttft_s, 50)) for r in group],
            "ttft_ms_p99": ms(percentile(ttft, 99)),
            "itl_ms_p50": ms(percentile(itl, 50)),
            "itl_ms_p99": ms(percentile(itl, 99)),
            "num_output_tokens": sum(r.num_tokens for r in group),
            "wall_s": round(sum(r.wall_s for r in group), 2),
        }
        counters = [r.engine for r in group if r.engine is not None and r.engine.steps]
        if counters:
            total = sum(counters, EngineSteps())
            row["engine_steps"] = total.steps
            row["engine_step_ms_mean"] = ms(total.step_s / total.steps)
            row["engine_step_stall_ms_mean"] = _stall_ms(total)
            row["engine_step_stall_ms_by_round"] = [_stall_ms(e) for e in counters]
        queue = [v for r in group for v in r.queue_s]
        if queue:
            row["queue_ms_mean"] = ms(statistics.fmean(queue))
        if path:
            row["serving_path_ttft_ms_p50"] = ms(percentile(path, 50))
            row["serving_path_ttft_ms_p99"] = ms(percentile(path, 99))
            row["serving_path_ttft_ms_mean"] = ms(statistics.fmean(path))
        results.append(row)
    by = {(r["system"], r["concurrency"]): r for r in results}
    overhead = {}
    for peer in ("engine_loop", "engine_step"):
        overhead[f"grpc_vs_{peer}"] = {
            str(c): _cost(by[("grpc", c)], by[(peer, c)], groups[("grpc", c)], groups[(peer, c)])
            for (system, c) in by
            if system == "grpc" and (peer, c) in by
        }
    open_loop = _open_loop(by, groups)
    goal = None
    at = overhead["grpc_vs_engine_loop"].get(str(GOAL_CONCURRENCY))
    if at is not None:
        grpc, peer = by[("grpc", GOAL_CONCURRENCY)], by[("engine_loop", GOAL_CONCURRENCY)]
        path_ms = grpc["serving_path_ttft_ms_p50"]
        goal_open = _open_goal(open_loop) if open_loop else {}
        open_path_ms = goal_open.get("open_loop_serving_path_ttft_ms_mean")
        goal = {
            "concurrency": GOAL_CONCURRENCY,
            "throughput_loss": at["throughput_loss"],
            "serving_path_ttft_ms_p50": path_ms,
            "serving_path_ttft_ms_p99": grpc["serving_path_ttft_ms_p99"],
            # Reported, not judged: in a closed loop a request's TTFT is decided by the step
            # boundary it catches (a decode step at N = 8 is ~95 ms), so the p50 moves between
            # rounds of one and the same system by more than 5 ms. The spread says by how much.
            "ttft_ms_p50_added": at["ttft_ms_p50_added"],
            "ttft_ms_p50_added_by_round": at["ttft_ms_p50_added_by_round"],
            "peer_ttft_ms_p50_round_spread": round(max(peer["ttft_ms_p50_by_round"]) - min(peer["ttft_ms_p50_by_round"]), 2),
            **goal_open,
            "serving_path_met": at["throughput_loss"] <= GOAL_THROUGHPUT_LOSS
            and path_ms <= GOAL_TTFT_ADDED_MS
            and (open_path_ms is None or open_path_ms <= GOAL_TTFT_ADDED_MS),
        }
        # End to end, the TTFT added also holds whatever makes the worker's own time to first
        # token longer than the in-process engine's (open_loop["ttft_ms_added_mean_split"]):
        # a slower engine (open_loop["engine_vs_bracket"]), a longer queue, or chance.
        goal["end_to_end_met"] = None if open_loop is None else goal_open["open_loop_ttft_ms_added_paired_mean"] <= GOAL_TTFT_ADDED_MS
        goal["met"] = goal["serving_path_met"] and goal["end_to_end_met"] is not False
    return {
        "results": results,
        "serving_overhead": overhead,
        "open_loop": open_loop,
        "disaggregated_vs_aggregated": _versus(by, "grpc_disaggregated", "grpc"),
        "goal": goal,
    }


def _open_loop(by: dict, groups: dict) -> dict | None:
    """gRPC against the in-process loop on one Poisson schedule: requests arrive when they
    arrive, not when a step ends. Each request is paired with the same-index request of the other
    system's run in the same round (same arrival time, same lengths).

    A request waits for the step running when it arrives (up to a whole step, ~80 ms at N = 8),
    and two runs of one schedule catch independent step phases, so single pairs differ by tens
    of milliseconds either way. Arrival phase is uniform over a step, so a path d ms slower adds d
    to the expected TTFT: the paired mean is the estimate of what the serving path costs, with a
    bootstrap 95% interval. The in-process loop runs again on the schedule after the gRPC run
    (``engine_loop_open_repeat``): paired with the first, it is an A/A control, which found later
    runs slower by more than the serving path costs (the machine drifts); averaged with the first,
    it brackets the gRPC run, and the difference to that bracket is what the goal judges."""
    key_grpc, key_loop, key_repeat = (("grpc_open", GOAL_CONCURRENCY), ("engine_loop_open", GOAL_CONCURRENCY), ("engine_loop_open_repeat", GOAL_CONCURRENCY))
    if key_grpc not in by or key_loop not in by:
        return None
    out = {
        "concurrency": GOAL_CONCURRENCY,
        "ttft_ms_p50_added": round(by[key_grpc]["ttft_ms_p50"] - by[key_loop]["ttft_ms_p50"], 2),
        "ttft_ms_added_paired": _paired(groups[key_grpc], groups[key_loop]),
    }
    if key_repeat in by:
        out["control_ttft_ms_paired"] = _paired(groups[key_repeat], groups[key_loop])
        out["ttft_ms_added_vs_bracket"] = _paired(groups[key_grpc], [_bracket(a, b) for a, b in zip(groups[key_loop], groups[key_repeat])])
    added = out.get("ttft_ms_added_vs_bracket", out["ttft_ms_added_paired"])["mean"]
    path = by[key_grpc].get("serving_path_ttft_ms_mean")
    if path is not None:
        # added = serving path (hops, measured per request) + what the worker's own time to first
        # token exceeds the in-process TTFT by (inbox wait, a missed step, a slower engine).
        out["ttft_ms_added_mean_split"] = {"serving_path": path, "worker": round(added - path, 2)}
        pooled = [v * 1000 for run in groups[key_grpc] for v in run.path_ttft_s]
        out["serving_path_ttft_ms_mean_ci95"] = bootstrap_ci95(pooled, _mean)
    if all(run.stages_by_index for key in (key_grpc, key_loop) for run in groups[key]):
        # Where the added TTFT is: per stage, the same pairs' differences (they add up to the total).
        peer_runs = [_bracket(a, b) for a, b in zip(groups[key_loop], groups[key_repeat])] if key_repeat in groups else groups[key_loop]
        out["ttft_ms_added_by_stage"] = _paired_stages(groups[key_grpc], peer_runs)
        if key_repeat in groups:
            out["control_ttft_ms_by_stage"] = _paired_stages(groups[key_repeat], groups[key_loop])
        out["stage_ms_mean"] = {key[0]: _stage_means(groups[key]) for key in (key_grpc, key_loop, key_repeat) if key in groups}
        work = {key[0]: _prefill_work(groups[key]) for key in (key_grpc, key_loop, key_repeat) if key in groups and all(r.prefill_work_by_index for r in groups[key])}
        if "grpc_open" in work and "engine_loop_open" in work:
            out["prefill_work"] = work
            out["prefill_ms_added_split"] = _prefill_split(out["ttft_ms_added_by_stage"]["prefill"]["mean"], work)
    queue = {key[0]: by[key]["queue_ms_mean"] for key in (key_grpc, key_loop, key_repeat) if "queue_ms_mean" in by.get(key, {})}
    if queue:
        out["queue_ms_mean"] = queue  # the worker's side of the added TTFT: waiting for a step, or after it
    peers = [[run] for run in groups[key_loop]]
    if key_repeat in groups:
        peers = [[a, b] for a, b in zip(groups[key_loop], groups[key_repeat])]
    engine = _engine_versus(groups[key_grpc], peers)
    if engine is not None:
        out["engine_vs_bracket" if key_repeat in groups else "engine_vs_engine_loop_open"] = engine
    return out


def _engine_versus(runs: list[Run], peers: list[list[Run]]) -> dict | None:
    """How much longer the worker's engine took over the same work than the in-process engine
    (the mean of the runs either side): both compute the same tokens, so their time in steps
    compares directly. Split into the engine thread's CPU time (slower cores: another thread or
    process on the cores beside it, sharing caches, memory bandwidth and the host's cores) and its
    waits inside steps (GIL, preemption)."""
    if any(run.engine is None for run in runs) or any(p.engine is None for pair in peers for p in pair):
        return None
    per_round = [(run.engine, _mean_steps([p.engine for p in pair])) for run, pair in zip(runs, peers)]
    grpc = sum((g for g, _ in per_round), EngineSteps())
    peer = sum((p for _, p in per_round), EngineSteps())
    return {
        "tokens": {"grpc": grpc.tokens, "peer": round(peer.tokens)},
        "steps": {"grpc": grpc.steps, "peer": round(peer.steps)},
        "step_time_added": round(grpc.step_s / peer.step_s - 1, 4),
        "step_time_added_by_round": [round(g.step_s / p.step_s - 1, 4) for g, p in per_round],
        "cpu_time_added": round(grpc.cpu_s / peer.cpu_s - 1, 4),
        "stall_ms_per_step": {"grpc": _stall_ms(grpc), "peer": _stall_ms(peer)},
    }


def _mean_steps(runs: list[EngineSteps]) -> EngineSteps:
    """The runs' counters averaged (counts become fractional)."""
    total, n = sum(runs, EngineSteps()), len(runs)
    return EngineSteps(total.steps / n, total.tokens / n, total.step_s / n, total.cpu_s / n)


def _stall_ms(steps: EngineSteps) -> float:
    """Per step, the ms the engine thread spent inside steps without running (see EngineStats.step_cpu_s)."""
    return round(1000 * (steps.step_s - steps.cpu_s) / steps.steps, 3)


def _bracket(before: Run, after: Run) -> Run:
    """The in-process runs either side of a gRPC run, averaged request by request: the machine's
    drift over the three runs, if linear, cancels (an A-B-A design)."""
    both = [i for i in before.ttft_s_by_index if i in after.ttft_s_by_index]
    stages = {
        i: {s: (before.stages_by_index[i].get(s, 0.0) + after.stages_by_index[i].get(s, 0.0)) / 2 for s in STAGES}
        for i in both
        if i in before.stages_by_index and i in after.stages_by_index
    }
    ttft = {i: (before.ttft_s_by_index[i] + after.ttft_s_by_index[i]) / 2 for i in both}
    return Run("bracket", before.concurrency, before.round, ttft_s_by_index=ttft, stages_by_index=stages)


def _paired_stages(runs: list[Run], peer_runs: list[Run]) -> dict:
    """Per stage (``STAGES``), the mean over same-index pairs of the run's time in it minus the
    peer's, in ms, pooled with a bootstrap 95% interval and by round. A stage a system lacks
    (in-process: ``hops``, ``request_plane``) counts as 0 there, so the stages add up to the
    TTFT added."""
    pooled: dict[str, list[float]] = {s: [] for s in STAGES}
    by_round: dict[str, list[float]] = {s: [] for s in STAGES}
    for run, peer in zip(runs, peer_runs):
        both = [i for i in sorted(run.stages_by_index) if i in peer.stages_by_index]
        for stage in STAGES:
            diffs = [(run.stages_by_index[i].get(stage, 0.0) - peer.stages_by_index[i].get(stage, 0.0)) * 1000 for i in both]
            pooled[stage] += diffs
            by_round[stage].append(round(_mean(diffs), 2))
    return {
        stage: {"mean": round(_mean(values), 2), "mean_ci95": bootstrap_ci95(values, _mean), "mean_by_round": by_round[stage]}
        for stage, values in pooled.items()
    }


def _prefill_work(runs: list[Run]) -> dict:
    """Per request, the mean steps and step tokens of its prefill stage, and what a step token cost
    (the stage's time over its steps' tokens, pooled)."""
    pairs = [(run.stages_by_index[i]["prefill"], work) for run in runs for i, work in run.prefill_work_by_index.items() if i in run.stages_by_index]
    tokens = sum(w[1] for _, w in pairs)
    return {
        "steps_mean": round(_mean([w[0] for _, w in pairs]), 3),
        "step_tokens_mean": round(_mean([w[1] for _, w in pairs]), 1),
        "us_per_step_token": round(1e6 * sum(t for t, _ in pairs) / tokens, 2) if tokens else None,
    }


def _prefill_split(added_ms: float, work: dict) -> dict | None:
    """The prefill stage's added ms split into more work (gRPC's steps computed more tokens, at the
    peer's cost per token) and slower work (the rest: each token cost more)."""
    peers = [work[k] for k in ("engine_loop_open", "engine_loop_open_repeat") if k in work]
    if any(p["us_per_step_token"] is None for p in peers):
        return None
    peer_tokens = _mean([p["step_tokens_mean"] for p in peers])
    peer_us = _mean([p["us_per_step_token"] for p in peers])
    more = (work["grpc_open"]["step_tokens_mean"] - peer_tokens) * peer_us / 1000
    return {"more_step_tokens": round(more, 2), "slower_per_token": round(added_ms - more, 2)}


def _stage_means(runs: list[Run]) -> dict[str, float]:
    """Per stage, the mean ms a request of these runs spent in it (0 for a stage the system lacks)."""
    stages = [st for run in runs for st in run.stages_by_index.values()]
    return {stage: round(1000 * _mean([st.get(stage, 0.0) for st in stages]), 2) for stage in STAGES}


def _paired(runs: list[Run], peer_runs: list[Run]) -> dict:
    """TTFT differences of same-index requests, round by round: mean and median with bootstrap
    95% intervals, in ms."""
    pooled, means, medians = [], [], []
    for run, peer in zip(runs, peer_runs):
        diffs = [(run.ttft_s_by_index[i] - peer.ttft_s_by_index[i]) * 1000 for i in sorted(run.ttft_s_by_index) if i in peer.ttft_s_by_index]
        pooled += diffs
        means.append(round(_mean(diffs), 2))
        medians.append(round(_median(diffs), 2))
    return {
        "num_pairs": len(pooled),
        "mean": round(_mean(pooled), 2),
        "mean_ci95": bootstrap_ci95(pooled, _mean),
        "mean_by_round": means,
        "mean_ci95_over_rounds": t_ci95(means),
        "p50": round(_median(pooled), 2),
        "p50_ci95": bootstrap_ci95(pooled, _median),
        "p50_by_round": medians,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def bootstrap_ci95(values: list[float], statistic, resamples: int = 2000, seed: int = 0) -> list[float]:
    """Percentile bootstrap: the 2.5th and 97.5th percentiles of ``statistic`` over resamples
    of ``values`` with replacement (seeded, so a report is reproducible from its samples)."""
    rng = random.Random(seed)
    n = len(values)
    estimates = sorted(statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return [round(estimates[int(0.025 * resamples)], 2), round(estimates[int(0.975 * resamples) - 1], 2)]


_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student's t, 97.5th percentile, for 1 to 10 degrees of freedom."""


def t_975(df: int) -> float:
    """Student's t, 97.5th percentile, for ``df`` >= 1 degrees of freedom: from the table up to 10,
    past it from the normal quantile by the Cornish-Fisher expansion (within 0.001 there)."""
    if df <= len(_T_975):
        return _T_975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)


def t_ci95(values: list[float]) -> list[float] | None:
    """A 95% interval for the mean of ``values`` (one per round) from Student's t: the rounds are
    the independent units when the machine's speed drifts between them. None below two values."""
    n = len(values)
    if n < 2:
        return None
    mean = _mean(values)
    half = t_975(n - 1) * statistics.stdev(values) / n**0.5
    return [round(mean - half, 2), round(mean + half, 2)]


def _open_goal(open_loop: dict) -> dict:
    paired = open_loop.get("ttft_ms_added_vs_bracket", open_loop["ttft_ms_added_paired"])
    out = {
        "open_loop_against": "bracket" if "ttft_ms_added_vs_bracket" in open_loop else "engine_loop_open",
        "open_loop_ttft_ms_added_paired_mean": paired["mean"],
        "open_loop_ttft_ms_added_paired_mean_ci95": paired["mean_ci95"],
        "open_loop_ttft_ms_added_paired_mean_ci95_over_rounds": paired["mean_ci95_over_rounds"],
        "open_loop_ttft_ms_added_paired_mean_by_round": paired["mean_by_round"],
        "open_loop_ttft_ms_added_paired_p50": paired["p50"],
    }
    if "control_ttft_ms_paired" in open_loop:
        out["open_loop_control_paired_mean_ci95"] = open_loop["control_ttft_ms_paired"]["mean_ci95"]
    if "ttft_ms_added_mean_split" in open_loop:
        out["open_loop_serving_path_ttft_ms_mean"] = open_loop["ttft_ms_added_mean_split"]["serving_path"]
        out["open_loop_serving_path_ttft_ms_mean_ci95"] = open_loop["serving_path_ttft_ms_mean_ci95"]
    engine = open_loop.get("engine_vs_bracket") or open_loop.get("engine_vs_engine_loop_open")
    if engine is not None:
        out["open_loop_engine_step_time_added"] = engine["step_time_added"]
    return out


def _cost(run: dict, peer: dict, runs: list[Run], peer_runs: list[Run]) -> dict:
    by_round = [round(1 - (g.num_tokens / g.wall_s) / (p.num_tokens / p.wall_s), 4) for g, p in zip(runs, peer_runs)]
    return {
        "throughput_loss": round(1 - run["output_tok_per_s"] / peer["output_tok_per_s"], 4),
        "throughput_loss_by_round": by_round,
        "ttft_ms_p50_added": round(run["ttft_ms_p50"] - peer["ttft_ms_p50"], 2),
        "ttft_ms_p50_added_by_round": [round(g - p, 2) for g, p in zip(run["ttft_ms_p50_by_round"], peer["ttft_ms_p50_by_round"])],
    }


def _versus(by: dict, system: str, baseline: str) -> dict:
    out = {}
    for (name, c), run in by.items():
        base = by.get((baseline, c))
        if name == system and base:
            out[str(c)] = {
                "throughput_ratio": round(run["output_tok_per_s"] / base["output_tok_per_s"], 3),
                "ttft_ms_p50_delta": round(run["ttft_ms_p50"] - base["ttft_ms_p50"], 2),
                "itl_ms_p50_delta": round(run["itl_ms_p50"] - base["itl_ms_p50"], 2),
            }
    return out


def peer_environ(environ: dict[str, str]) -> dict[str, str] | None:
    """The environment the in-process engine must start in to run as a decode worker's engine
    does, or None if ``environ`` is that already. Ray sets ``OMP_NUM_THREADS``, where it is unset,
    to an actor's whole CPUs (at least 1) before the actor imports torch, and libgomp and MKL read
    it once, when they load. Set for the bench, Ray leaves it as it is and the workers inherit it,
    so the two engines start alike. (It is not why an actor's engine often steps faster than this
    process's: bench.actor_engine finds that with it set on both sides too.)"""
    if "OMP_NUM_THREADS" in environ:
        return None
    return dict(environ) | {"OMP_NUM_THREADS": str(max(math.floor(ReplicaSpec.num_cpus), 1))}


def claim_engine_cpus(text: str) -> tuple[frozenset[int], frozenset[int]]:
    """The engine's CPUs from ``text`` and the serving CPUs this process moved its threads to;
    ValueError naming the problem. Call it before Ray starts: its daemons, the router and the
    workers inherit the serving CPUs. The bench's worker runs on this machine, so a CPU this
    process may not use is refused here rather than when the worker pins its engine, minutes in."""
    engine_cpus = parse_cpu_list(text)
    allowed = frozenset(os.sched_getaffinity(0))
    if not engine_cpus <= allowed:
        raise ValueError(f"CPUs {format_cpu_list(engine_cpus - allowed)} are not among this process's CPUs ({format_cpu_list(allowed)})")
    return engine_cpus, move_serving_threads(engine_cpus)


def _cluster(engine_config: EngineConfig, threads: int, disaggregated: bool, engine_cpus: str | None) -> Cluster:
    worker_threads = max(1, threads // 2) if disaggregated else threads
    return Cluster(
        ClusterConfig(
            engine=engine_config,
            worker=WorkerConfig(num_threads=worker_threads, engine_cpus=engine_cpus),
            prefill=PrefillWorkerConfig(num_threads=worker_threads),
            router=RouterConfig(port=0),
            num_prefill=1 if disaggregated else 0,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--num-requests", type=int, default=None, help="per run (default: 4 x N, at least 16, at most 64)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="alternations of engine_step, engine_loop and grpc per concurrency")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--open-requests", type=int, default=64, help=f"per open-loop run at N = {GOAL_CONCURRENCY} (0: no open-loop runs; default: 64)"
    )
    parser.add_argument(
        "--open-load",
        type=float,
        default=0.6,
        help="open-loop arrival rate as a fraction of the request rate engine_loop sustained closed-loop (default: 0.6)",
    )
    parser.add_argument("--open-rounds", type=int, default=4, help="rounds of the three open-loop runs (default: 4)")
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"], choices=["aggregated", "disaggregated"])
    parser.add_argument(
        "--engine-cpus",
        default=None,
        metavar="LIST",
        help="CPUs (e.g. 0) for the engine, in-process and in the worker alike; the bench, its clients, Ray, the router "
        "and the workers' serving threads get the others. Aggregated mode only. (default: everything shares every CPU)",
    )
    # What the in-process engine starts with, beside a worker's (see peer_environ).
    print(f"bench.e2e: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", file=sys.stderr, flush=True)
    args = parser.parse_args(argv)

    engine_cpus = serving = None
    if args.engine_cpus is not None:
        if "disaggregated" in args.modes:
            parser.error("--engine-cpus: only with --modes aggregated (a prefill and a decode engine would share the CPUs)")
        try:
            engine_cpus, serving = claim_engine_cpus(args.engine_cpus)
        except ValueError as e:
            parser.error(f"--engine-cpus: {e}")
    threads = len(engine_cpus) if engine_cpus else torch.get_num_threads()
    engine_config = EngineConfig(model=args.model, kv_dtype=args.kv_dtype, kv_cache_bytes=2 << 30)
    # One engine for both in-process systems, built and stepped on the EngineLoop's thread only:
    # this thread never runs a torch op (see engine/engine_loop.py on OpenMP teams). It runs with
    # the worker process's settings, so the in-process peer differs from a worker only by what
    # sits between client and engine.
    process = WorkerProcessConfig()
    sys.setswitchinterval(process.gil_switch_interval_s)
    loop = EngineLoop(
        lambda: LLMEngine(engine_config), max_waiting_requests=1 << 20, num_threads=threads, nice=process.engine_thread_nice, cpus=engine_cpus
    )
    loop.start()
    vocab_size = loop.engine.model_config.vocab_size
    workloads = {
        c: random_workload(
            args.num_requests or min(64, max(16, 4 * c)), tuple(args.prompt_len), tuple(args.output_len), vocab_size, NUM_SPECIAL_TOKENS, args.seed + c
        )
        for c in args.concurrency
    }
    tags = iter(range(NUM_SPECIAL_TOKENS, vocab_size))
    warmup = [BenchRequest(tuple(range(100, 100 + n)), 4) for n in (40, 70)]

    def log(run: Run, r: int) -> Run:
        run.round = r
        line = {"system": run.system, "concurrency": run.concurrency, "round": run.round, "tok_per_s": round(run.num_tokens / run.wall_s, 2)}
        if run.engine is not None and run.engine.steps:
            line |= {"step_ms": round(1000 * run.engine.step_s / run.engine.steps, 2), "stall_ms": _stall_ms(run.engine)}
        if run.stages_by_index:
            line["stage_ms"] = _stage_means([run])
        print(json.dumps(line), file=sys.stderr, flush=True)
        return run

    runs: list[Run] = []
    open_rate = None
    asyncio.run(loop.call(lambda engine: run_engine_step(engine, warmup, 2)))
    run_engine_loop(loop, warmup, 2)
    for mode in args.modes:
        disaggregated = mode == "disaggregated"
        system = "grpc_disaggregated" if disaggregated else "grpc"
        cluster = _cluster(engine_config, threads, disaggregated, args.engine_cpus)
        status = cluster.start()
        try:
            with SplitServeClient(status.grpc_address) as client:
                [decode_metrics] = [r.metrics_url for r in client.cluster_status().replicas if r.pool == "decode"]
                in_process, worker = (lambda: loop_steps(loop)), (lambda: scraped_steps(decode_metrics))
                run_grpc(client, warmup, 2, system)
                for c in args.concurrency:
                    for r in range(1 if disaggregated else args.rounds):
                        if not disaggregated:
                            step_wl, loop_wl = variant(workloads[c], next(tags)), variant(workloads[c], next(tags))
                            runs.append(log(counted(in_process, lambda: asyncio.run(loop.call(lambda e, w=step_wl, c=c: run_engine_step(e, w, c)))), r))
                            runs.append(log(counted(in_process, lambda: run_engine_loop(loop, loop_wl, c)), r))
                        grpc_wl = variant(workloads[c], next(tags))
                        runs.append(log(counted(worker, lambda: run_grpc(client, grpc_wl, c, system)), r))
                    if c == GOAL_CONCURRENCY and not disaggregated and args.open_requests:
                        closed = [run for run in runs if (run.system, run.concurrency) == ("engine_loop", c)]
                        open_rate = args.open_load * len(workloads[c]) * len(closed) / sum(run.wall_s for run in closed)
                        open_wl = random_workload(args.open_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, NUM_SPECIAL_TOKENS, args.seed + 1000)
                        arrivals = poisson_arrivals(len(open_wl), open_rate, args.seed)
                        for r in range(args.open_rounds):
                            first, middle, last = (variant(open_wl, next(tags)) for _ in range(3))
                            runs.append(log(counted(in_process, lambda: run_engine_loop_open(loop, first, arrivals, c)), r))
                            runs.append(log(counted(worker, lambda: run_grpc_open(client, middle, arrivals, c)), r))
                            runs.append(log(counted(in_process, lambda: run_engine_loop_open(loop, last, arrivals, c, "engine_loop_open_repeat")), r))
        finally:
            cluster.stop()
    loop.stop()
    report = {
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "torch_threads": threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "engine_cpus": format_cpu_list(engine_cpus) if engine_cpus else None,
        "serving_cpus": format_cpu_list(serving) if serving else None,
        "num_requests": {str(c): len(w) for c, w in workloads.items()},
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "open_loop_rate_per_s": round(open_rate, 4) if open_rate else None,
        "open_loop_requests": args.open_requests if open_rate else None,
        "open_loop_load": args.open_load if open_rate else None,
        "open_loop_rounds": args.open_rounds if open_rate else None,
        **summarize(runs),
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    environ = peer_environ(dict(os.environ))
    if environ is not None:  # torch, imported above, has loaded libgomp: start again with the worker's
        os.execve(sys.executable, [sys.executable, "-m", "bench.e2e", *sys.argv[1:]], environ)
    sys.exit(main())
