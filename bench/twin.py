"""One engine, two doors: what the serving path adds to a first token, twin by twin.

    python -m bench.twin --json OUT

bench.e2e runs one schedule through gRPC and again on an engine in its own process. The two
runs' steps fall differently (a ~340 ms prompt step here, a ~80 ms decode step there), so one
request's TTFT differs between them by ~46 ms at random, and the two engines' processes may
differ in speed by 2-3% (bench.actor_engine). Telling a 3.5 ms path from the 5 ms goal that way
takes ~55 runs (bench.e2e_pool's ``power``).

Here there is one engine and one schedule. Requests come in twins, on a Poisson schedule of
``--pair-rate`` pairs per second: one twin leaves a client thread here through the router's gRPC,
and the other is handed to the same decode worker's ``EngineLoop`` from a coroutine on that
worker's own event loop, as an application would call the engine as a library. Times are
``time.monotonic``, one clock for every process on the machine. The twins have prompts of one
length that differ in their first token (so neither finds the other's blocks cached) and one
output length. Each twin's TTFT runs from its own handover, and each pair's difference (through
gRPC minus direct) is what the serving path cost, on the same engine, the same steps and the same
process:

- twins that the engine takes in at one step boundary share their prompt step, and differ by the
  hops back from the worker plus ``delay`` (below);
- a twin that reaches the engine after a boundary its sibling made ("missed") waits a whole step
  more: that step holds its sibling's prompt, so it is longer than the average step. For arrivals
  at random moments a miss happens with probability gap / mean step.

If the direct twin were handed over at the same moment as the gRPC one, it would reach the engine
first every time, and the gRPC twin's misses would each cost a step that holds its sibling's
prompt (measured: 346 ms against a 187 ms mean step). That overcharges the path: a lone request
that misses a boundary waits for an ordinary step. (Chunked prefill adds to it: the later twin's
prompt is the one split when the pair overflows the step's token budget.) So the direct twin is
handed over ``delay`` after its gRPC twin, ``delay`` being the gRPC twins' mean way in to the
worker (``--direct-delay-ms``; by default measured on 20 probe pairs). The twins then reach the
engine in either order, the misses fall on both sides at the same cost and cancel on average,
and the mean difference is the path's whole cost: its way in (the direct twin's later start) and
its way out (the same-step difference over ``delay``).

The default workload splits a bench.e2e request in two: prompts of 16-128 and outputs of 16-64
tokens, pairs at bench.e2e's open-loop request rate (0.33/s). Beside them ``--busy-streams`` (6)
closed-loop gRPC streams keep the engine from ever idling (an idle engine starts a step for
whichever twin comes first, alone) and put ~8 requests in flight, as at N = 8. Chunked prefill
splits a prompt when a step's token budget runs out; ``prefill_steps`` in the report counts it.
The engine runs alone on ``--engine-cpus`` (0), as in bench.e2e's ``--engine-cpus 0`` runs.

What the twins cannot show is a cost the serving stack puts on the engine itself (both twins
pay it): bench.e2e's step counters measure that, worker against in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from bench.e2e import GOAL_TTFT_ADDED_MS, NUM_SPECIAL_TOKENS, EngineSteps, claim_engine_cpus, scraped_steps, t_975, trace_stages
from bench.workload import BenchRequest, emit_report, percentile, random_workload
from decode_worker.actor import DecodeWorker
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.cpus import format_cpu_list
from engine.params import SamplingParams
from engine.request import EngineRequest, RequestTrace
from router.client import SplitServeClient
from router.config import RouterConfig
from router.launch import Cluster, ClusterConfig

TWIN_WORKER_CLASS = "bench.twin:TwinDecodeWorker"
IDLE_PICKUP_S = 0.0005
"""A direct twin taken in this soon found the engine thread waiting for work, not stepping."""
SAME_STEP_S = 0.005
"""Two requests whose first steps began closer than this ran in one step: the scheduler stamps
each as it takes it (microseconds apart), and no step is this short."""


@dataclass(frozen=True)
class Twin:
    """One request of a pair as one door saw it; times in ``time.monotonic`` seconds."""

    sent_s: float
    """Handed to the client (gRPC) or to the EngineLoop (direct)."""
    first_token_s: float
    """Its first token reached the caller (the client thread, or the coroutine on the worker)."""
    trace: RequestTrace
    """The engine's trace: ``arrival_s`` is when it reached the worker (gRPC) or was handed over (direct)."""
    resumed_s: float
    """Its first token reached the worker's event loop: the coroutine (direct) or the request's stream (gRPC)."""
    request_plane_s: float = 0.0
    """gRPC only: the worker's request plane, Submit frame read to the request starting."""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s


@dataclass(frozen=True)
class Pair:
    index: int
    grpc: Twin
    direct: Twin

    @property
    def added_s(self) -> float:
        return self.grpc.ttft_s - self.direct.ttft_s

    @property
    def same_step(self) -> bool:
        """The engine ran both prompts' first step together (neither missed a boundary the other made)."""
        return abs(self.grpc.trace.first_scheduled_s - self.direct.trace.first_scheduled_s) < SAME_STEP_S

    @property
    def gap_s(self) -> float:
        """How much later the gRPC twin reached the engine than its direct twin."""
        return self.grpc.trace.arrival_s - self.direct.trace.arrival_s


@dataclass(frozen=True)
class ScheduledTwin:
    index: int
    at_s: float
    """``time.monotonic`` at which to hand it over."""
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


class TwinDecodeWorker(DecodeWorker):
    """A decode worker that also runs direct twins on its own engine, and keeps every trace.

    It is started by the controller like any decode replica (``ClusterConfig.decode_worker_class``),
    so the gRPC twins take the production path; only ``direct`` and the kept traces are the bench's.
    """

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._traces: dict[str, tuple[RequestTrace, float]] = {}
        generate = self.loop.generate

        async def traced(request: EngineRequest, admit=None):
            resumed = None
            async for output in generate(request, admit):
                if resumed is None and getattr(output, "new_token_ids", None):
                    resumed = time.monotonic()
                if getattr(output, "finished", False):
                    self._traces[request.request_id] = (output.trace, resumed)
                yield output

        self.loop.generate = traced  # the request's stream, as DecodeWorker.generate reads it

    async def traces(self, request_ids: list[str]) -> dict[str, tuple[RequestTrace, float]]:
        """The engine's trace and first-token time of each finished request asked for (and forget them)."""
        return {rid: self._traces.pop(rid) for rid in request_ids if rid in self._traces}

    async def direct(self, twins: list[ScheduledTwin], tag: str) -> dict[int, Twin]:
        """Hand each twin to this worker's EngineLoop at its time, from this event loop; per index, what it saw."""

        async def one(twin: ScheduledTwin) -> tuple[int, Twin]:
            await asyncio.sleep(max(0.0, twin.at_s - time.monotonic()))
            sent = time.monotonic()
            request = EngineRequest(f"direct-{tag}-{twin.index}", list(twin.prompt_token_ids), None, _params(twin.max_tokens), None, arrival_s=sent)
            first = None
            async for output in self.loop.generate(request):
                if first is None and output.new_token_ids:
                    first = time.monotonic()
            trace, resumed = self._traces.pop(request.request_id)
            return twin.index, Twin(sent, first, trace, resumed)

        return dict(await asyncio.gather(*(one(t) for t in twins)))


def schedule(num_pairs: int, pair_rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int) -> list[tuple[float, BenchRequest, BenchRequest]]:
    """Per pair: seconds from the start, then the gRPC twin and the direct twin. The twins' prompts
    differ only in their first token (each chains every block key, so neither shares a block with
    any other request); which door gets the lower token alternates."""
    base = random_workload(num_pairs, prompt_len, output_len, vocab_size, NUM_SPECIAL_TOKENS, seed)
    rng = random.Random(seed)
    out, t = [], 0.0
    for i, req in enumerate(base):
        t += rng.expovariate(pair_rate)
        low, high = (BenchRequest((NUM_SPECIAL_TOKENS + 2 * i + k,) + req.prompt_token_ids[1:], req.num_output_tokens) for k in (0, 1))
        out.append((t, low, high) if i % 2 == 0 else (t, high, low))
    return out


def run_grpc_twin(client: SplitServeClient, index: int, req: BenchRequest, at_s: float, tag: str) -> tuple[int, str, float, float, float]:
    """Send one gRPC twin at ``at_s``: its index, request id, when sent, its first token, its request plane wait."""
    time.sleep(max(0.0, at_s - time.monotonic()))
    request_id = f"grpc-{tag}-{index}"
    sent = time.monotonic()
    first, last = None, None
    for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True, request_id=request_id):
        if first is None and response.token_ids:
            first = time.monotonic()
        last = response
    return index, request_id, sent, first, last.timings.request_plane_s


def block_bootstrap_ci95(values: list[float], block: int, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the mean of a series whose neighbours may be
    correlated (pairs share the engine's timeline): resamples of whole consecutive blocks."""
    n = len(values)
    block = max(1, min(block, n))
    starts = range(n - block + 1)
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        sample: list[float] = []
        while len(sample) < n:
            s = rng.choice(starts)
            sample.extend(values[s : s + block])
        means.append(statistics.fmean(sample[:n]))
    means.sort()
    return [round(means[int(0.025 * resamples)], 2), round(means[int(0.975 * resamples) - 1], 2)]


def _ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ms = [1000 * v for v in values]
    return {"n": len(ms), "mean": round(statistics.fmean(ms), 3), "p50": round(percentile(ms, 50), 3)}


def _stages(twin: Twin) -> dict[str, float]:
    """Where the worker's part of a twin's TTFT went (s), as bench.e2e splits an in-process request's."""
    return trace_stages(twin.trace, twin.resumed_s)


def summarize(pairs: list[Pair], steps: EngineSteps, block: int = 10) -> dict:
    """The report: the TTFT added per pair (mean with a block-bootstrap interval, over every pair
    and over the pairs whose twins shared their first step), the misses against what the gap
    predicts, each door's stages, and the verdict against the goal."""
    pairs = sorted(pairs, key=lambda p: p.index)
    added = [1000 * p.added_s for p in pairs]
    same = [p for p in pairs if p.same_step]
    missed = [p for p in pairs if not p.same_step]
    mean_step_s = steps.step_s / steps.steps if steps.steps else None
    gap_s = statistics.fmean(p.gap_s for p in pairs)
    abs_gap_s = statistics.fmean(abs(p.gap_s) for p in pairs)
    grpc_hops = [p.grpc.ttft_s - (p.grpc.resumed_s - p.grpc.trace.arrival_s) - p.grpc.request_plane_s for p in pairs]
    stage_added = {
        name: round(1000 * statistics.fmean(_stages(p.grpc)[name] - _stages(p.direct)[name] for p in same), 3) if same else None
        for name in ("pickup", "wait", "prefill", "handback")
    }
    mean = statistics.fmean(added)
    sd = statistics.stdev(added) if len(added) > 1 else 0.0
    half = t_975(len(added) - 1) * sd / len(added) ** 0.5 if len(added) > 1 else math.inf
    t_ci = [round(mean - half, 2), round(mean + half, 2)]
    boot_ci = block_bootstrap_ci95(added, block)
    # The mean hangs on a few misses (~0.5% of pairs, ~350 ms each): the verdict takes the wider
    # of the two intervals at each end.
    ci = [min(t_ci[0], boot_ci[0]), max(t_ci[1], boot_ci[1])]
    report = {
        "num_pairs": len(pairs),
        "ttft_ms": {"grpc": _ms([p.grpc.ttft_s for p in pairs]), "direct": _ms([p.direct.ttft_s for p in pairs])},
        "ttft_ms_added": {
            "mean": round(mean, 2),
            "mean_ci95": ci,
            "mean_ci95_t": t_ci,
            "mean_ci95_block_bootstrap": boot_ci,
            "p50": round(percentile(added, 50), 2),
            "sd": round(sd, 2),
            "bootstrap_block_pairs": block,
        },
        "same_step": {
            "num_pairs": len(same),
            "ttft_ms_added": _ms([p.added_s for p in same]),
            "of_which_hops_ms": _ms([grpc_hops[i] for i, p in enumerate(pairs) if p.same_step]),
            "of_which_request_plane_ms": _ms([p.grpc.request_plane_s for p in same]),
            "stage_ms_added": stage_added,
            "prefill_step_tokens": {
                "grpc": round(statistics.fmean(p.grpc.trace.prefill_step_tokens for p in same), 1) if same else None,
                "direct": round(statistics.fmean(p.direct.trace.prefill_step_tokens for p in same), 1) if same else None,
            },
        },
        "missed": {
            "num_pairs": len(missed),
            "fraction": round(len(missed) / len(pairs), 4),
            "expected_fraction": round(abs_gap_s / mean_step_s, 4) if mean_step_s else None,
            "ttft_ms_added": _ms([p.added_s for p in missed]),
            "grpc_later": sum(1 for p in missed if p.grpc.trace.first_scheduled_s > p.direct.trace.first_scheduled_s),
            "direct_later": sum(1 for p in missed if p.grpc.trace.first_scheduled_s < p.direct.trace.first_scheduled_s),
        },
        "gap_ms": round(1000 * gap_s, 3),
        "abs_gap_ms": round(1000 * abs_gap_s, 3),
        "idle_arrivals": sum(1 for p in pairs if _stages(p.direct)["pickup"] < IDLE_PICKUP_S),
        "hops_ms": _ms(grpc_hops),
        "prefill_steps": {
            "grpc": round(statistics.fmean(p.grpc.trace.prefill_steps for p in pairs), 3),
            "direct": round(statistics.fmean(p.direct.trace.prefill_steps for p in pairs), 3),
        },
        "pairs": [[p.index, round(1000 * p.added_s, 3), p.same_step, round(1000 * p.gap_s, 3)] for p in pairs],
        "engine": {
            "steps": steps.steps,
            "tokens": steps.tokens,
            "step_ms_mean": round(1000 * mean_step_s, 2) if mean_step_s else None,
        },
    }
    report["goal"] = {
        "ttft_ms_added_max": GOAL_TTFT_ADDED_MS,
        "within_goal": mean <= GOAL_TTFT_ADDED_MS,
        "shown_within_goal": ci[1] <= GOAL_TTFT_ADDED_MS,
        "shown_over_goal": ci[0] > GOAL_TTFT_ADDED_MS,
    }
    return report


def keep_busy(client: SplitServeClient, streams: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int) -> tuple[threading.Event, list[threading.Thread]]:
    """``streams`` closed-loop gRPC clients, each sending its next request when the last ends,
    until the returned event is set: the engine always has requests when a twin arrives."""
    stop = threading.Event()

    def loop(stream: int) -> None:
        rng = random.Random(seed + stream)
        n = 0
        while not stop.is_set():
            [req] = random_workload(1, prompt_len, output_len, vocab_size, NUM_SPECIAL_TOKENS, rng.randrange(1 << 30))
            for _ in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True, request_id=f"busy-{seed}-{stream}-{n}"):
                pass
            n += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    return stop, threads


def run(
    client: SplitServeClient, worker, plan: list[tuple[float, BenchRequest, BenchRequest]], tag: str, chunk: int = 25, lead_s: float = 3.0, delay_s: float = 0.0
) -> list[Pair]:
    """Run ``plan`` through both doors, ``lead_s`` from now (time for the direct twins' calls to
    reach the worker), each direct twin ``delay_s`` after its gRPC twin; every pair, once both
    twins have finished."""
    start = time.monotonic() + lead_s
    direct_refs = []
    for i in range(0, len(plan), chunk):
        twins = [ScheduledTwin(j, start + at + delay_s, d.prompt_token_ids, d.num_output_tokens) for j, (at, _, d) in enumerate(plan[i : i + chunk], i)]
        direct_refs.append(worker.direct.remote(twins, tag))
    results: list = []
    lock = threading.Lock()

    def one(index: int, req: BenchRequest, at_s: float) -> None:
        result = run_grpc_twin(client, index, req, at_s, tag)
        with lock:
            results.append(result)
            done = len(results)
        if done % 50 == 0:
            print(json.dumps({"pairs_sent": done, "of": len(plan)}), file=sys.stderr, flush=True)

    threads = []
    for index, (at, g, _) in enumerate(plan):
        time.sleep(max(0.0, start + at - 0.2 - time.monotonic()))
        thread = threading.Thread(target=one, args=(index, g, start + at), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    direct: dict[int, Twin] = {}
    for ref in direct_refs:
        direct |= ray.get(ref)
    traces = ray.get(worker.traces.remote([rid for _, rid, *_ in results]))
    pairs = []
    for index, rid, sent, first, request_plane_s in results:
        trace, resumed = traces[rid]
        pairs.append(Pair(index, Twin(sent, first, trace, resumed, request_plane_s), direct[index]))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pairs", type=int, default=600, help="twin pairs (default: 600, ~30 minutes at the default rate)")
    parser.add_argument("--pair-rate", type=float, default=0.33, help="pairs per second, Poisson (default: 0.33)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    parser.add_argument("--busy-streams", type=int, default=6, help="closed-loop gRPC streams beside the twins, so the engine is never idle (default: 6)")
    parser.add_argument(
        "--direct-delay-ms",
        type=float,
        default=None,
        help="hand each direct twin over this long after its gRPC twin leaves (default: the gRPC twins' mean way in to the worker, "
        "measured on 20 probe pairs under the busy streams; 0: both at one moment)",
    )
    parser.add_argument("--engine-cpus", default="0", metavar="LIST", help="CPUs of the worker's engine; everything else runs on the rest (default: 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.pairs < 2:
        parser.error(f"--pairs: at least 2, got {args.pairs}")
    if args.busy_streams < 1:
        parser.error(f"--busy-streams: at least 1 (an idle engine starts a step for the first twin alone), got {args.busy_streams}")
    if args.direct_delay_ms is not None and args.direct_delay_ms < 0:
        parser.error(f"--direct-delay-ms: must be >= 0, got {args.direct_delay_ms}")
    if args.pair_rate <= 0:
        parser.error(f"--pair-rate: must be > 0, got {args.pair_rate}")
    for name in ("prompt_len", "output_len"):
        low, high = getattr(args, name)
        if not 2 <= low <= high:
            parser.error(f"--{name.replace('_', '-')}: need 2 <= MIN <= MAX, got {low} {high}")
    try:
        engine_cpus, serving = claim_engine_cpus(args.engine_cpus)
    except ValueError as e:
        parser.error(f"--engine-cpus: {e}")

    engine_config = EngineConfig(model=args.model, kv_cache_bytes=2 << 30)
    cluster = Cluster(
        ClusterConfig(
            engine=engine_config,
            worker=WorkerConfig(num_threads=len(engine_cpus), engine_cpus=args.engine_cpus),
            router=RouterConfig(port=0),
            decode_worker_class=TWIN_WORKER_CLASS,
        )
    )
    status = cluster.start()
    try:
        with SplitServeClient(status.grpc_address) as client:
            [(replica, _, worker)] = ray.get(cluster.controller.replicas.remote())
            vocab_size = client.list_models()[0].vocab_size
            warmup = schedule(4, 2.0, (40, 70), (4, 4), vocab_size, args.seed + 1)
            run(client, worker, warmup, "warmup")
            plan = schedule(args.pairs, args.pair_rate, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed)
            stop, busy = keep_busy(client, args.busy_streams, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed + 2)
            try:
                time.sleep(5.0)  # the busy streams' first prompts
                delay_s = args.direct_delay_ms / 1000 if args.direct_delay_ms is not None else None
                if delay_s is None:
                    # The gRPC twins' way in under this load, so that the twins reach the engine
                    # in either order about as often (see the module docstring).
                    probe = run(client, worker, schedule(20, 2.0, tuple(args.prompt_len), (4, 4), vocab_size, args.seed + 3), "probe")
                    delay_s = statistics.fmean(p.grpc.trace.arrival_s - p.grpc.sent_s for p in probe)
                before = scraped_steps(replica.metrics_url)
                pairs = run(client, worker, plan, "run", delay_s=delay_s)
                steps = scraped_steps(replica.metrics_url) - before
            finally:
                stop.set()
                for thread in busy:
                    thread.join()
    finally:
        cluster.stop()
    report = {
        "model": args.model,
        "engine_cpus": format_cpu_list(engine_cpus),
        "serving_cpus": format_cpu_list(serving),
        "pair_rate_per_s": args.pair_rate,
        "busy_streams": args.busy_streams,
        "direct_delay_ms": round(1000 * delay_s, 3),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "max_num_batched_tokens": engine_config.max_num_batched_tokens,
        **summarize(pairs, steps),
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
