"""Trace replay of cache-aware routing: the real prefix index and policies against simulated workers.

    python -m bench.routing --trace FILE [--generate KIND] [--shapes DIR] [--sensitivity] [--live] --json OUT
    python -m bench.routing --live [--json OUT]          the live routing step alone

With ``--generate`` a seeded trace (bench/traces.py) is written to FILE first. The trace is
replayed once per policy through the simulated cluster of bench/routing_sim.py (its docstring
has the model and its H100 defaults); per policy: hit ratios per tier, load balance, TTFT
percentiles and the wall-clock time of the real ``policy.choose`` calls, beside the trace's
oracle hit ratio and the goals. ``--shapes DIR`` does the same for every generated kind (its
trace DIR/KIND.jsonl, written if missing); ``--sensitivity`` replays splitserve again with each
policy parameter halved and doubled; ``--live`` times the router's own routing step (see
``live_decisions``).
"""

from __future__ import annotations

import dataclasses
import gc
import random
import sys
import time
from pathlib import Path

from bench.report import BenchError, arg_parser, emit_report, machine, percentile, plot, positive, progress, run
from bench.routing_sim import ClusterConfig, Replay, oracle_hit_ratio
from bench.traces import KINDS, TraceConfig, TraceRequest, describe, generate, read_trace, write_trace
from cli.args import add_dataclass_args, dataclass_from_args
from kv_store.events import EventKind, KVEvent, KVEventBatch, Tier
from kv_store.keys import NATIVE_CHAIN, KeyNamespace, block_keys
from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService
from router.routing.policy import POLICIES, PolicyConfig, make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.workers import Replica, WorkerDirectory, worker_load

SHAPES = KINDS
"""The generated kinds ``--shapes`` replays."""
SENSITIVITY = ("prefill_weight", "queue_weight", "balance_weight", "balance_window_s", "memory_s", "prefill_tokens_per_s", "cpu_load_tokens_per_s", "redis_load_tokens_per_s")
"""The splitserve parameters ``--sensitivity`` halves and doubles."""


def evaluate_goals(oracle: float, results: dict[str, dict]) -> dict:
    """The issue's goals for ``splitserve``, each with its value and whether it is met."""
    ours = results.get("splitserve")
    if ours is None:
        return {}
    baselines = {name: r["ttft_s_p90"] for name, r in results.items() if name != "splitserve"}
    best = min(baselines, key=baselines.get) if baselines else None
    ratio = ours["hit_ratio"] / oracle if oracle else None
    load, ttft, decide = ours["load_max_over_mean"], ours["ttft_s_p90"], ours["decide_us_p99_32k"]
    return {
        "hit_ratio_over_oracle": {"target": ">= 0.95", "value": ratio, "met": ratio is not None and ratio >= 0.95},
        "load_max_over_mean": {"target": "<= 1.10", "value": load, "met": load <= 1.10},
        "ttft_s_p90_below_every_baseline": {
            "target": f"< {baselines[best]:.3f} ({best})" if best else "< no baseline run",
            "value": ttft,
            "met": best is not None and ttft < baselines[best],
        },
        "decide_us_p99_32k": {"target": "<= 500", "value": decide, "met": None if decide is None else decide <= 500},
    }


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False, plot="hit ratio and TTFT p90 per policy")
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (with --generate: written first); without one, --live runs alone")
    parser.add_argument("--generate", choices=KINDS, help="write a seeded trace of this kind to --trace, then replay it")
    parser.add_argument("--requests", type=positive, default=20000, help="requests of a generated trace (default: 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace (default: 0)")
    parser.add_argument("--workers", type=int, default=ClusterConfig.num_workers, help="prefill workers")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--warmup-s", type=float, default=180.0, help="requests before this time warm the cluster and are not counted (default: 180)")
    parser.add_argument("--shapes", type=Path, help="also replay every generated kind from DIR/KIND.jsonl (written first if missing)")
    parser.add_argument("--sensitivity", action="store_true", help="replay splitserve with each parameter x0.5 and x2")
    parser.add_argument("--live", action="store_true", help="time the live router's routing step at 32k-token prompts")
    add_dataclass_args(parser, ClusterConfig, skip=("num_workers",))
    add_dataclass_args(parser, PolicyConfig, prefix="splitserve")
    add_dataclass_args(parser, TraceConfig, prefix="trace")
    args = parser.parse_args(argv)
    try:
        config = dataclass_from_args(ClusterConfig, args, num_workers=args.workers)
        policy_config = dataclass_from_args(PolicyConfig, args, prefix="splitserve")
        trace_config = dataclass_from_args(TraceConfig, args, prefix="trace")
    except ValueError as e:
        parser.error(str(e))
    if args.trace is None:
        if not args.live:
            parser.error("--trace is required (or --live alone)")
        emit_report({"live": live_decisions(), "machine": machine()}, args.json)
        return 0
    if args.generate:
        progress("routing", f"generating a {args.generate} trace of {args.requests} requests (seed {args.seed}) into {args.trace}")
        write_trace(generate(args.generate, args.requests, args.seed, trace_config), args.trace)
    trace = _read(args.trace, args.warmup_s)
    results = _replay_policies(trace, args.policies, config, policy_config, args.warmup_s)
    oracle = oracle_hit_ratio(trace, warmup_s=args.warmup_s)
    traces = {args.trace.stem: trace}
    shapes = {}
    for kind in SHAPES if args.shapes else ():
        path = args.shapes / f"{kind}.jsonl"
        if not path.is_file():
            write_trace(generate(kind, args.requests, args.seed, trace_config), path)
        traces[kind] = _read(path, args.warmup_s)
        replayed = _replay_policies(traces[kind], args.policies, config, policy_config, args.warmup_s)
        shapes[kind] = _summary(oracle_hit_ratio(traces[kind], warmup_s=args.warmup_s), replayed)
    report = {
        "trace": str(args.trace),
        "trace_stats": describe(trace),
        "warmup_s": args.warmup_s,
        "cluster": dataclasses.asdict(config),
        "splitserve_config": dataclasses.asdict(policy_config),
        "oracle_hit_ratio": oracle,
        "policies": results,
        "goals": evaluate_goals(oracle, results),
        "machine": machine(),
    }
    if shapes:
        report["shapes"] = shapes
    if args.sensitivity:
        report["sensitivity"] = {name: _sensitivity(t, config, policy_config, args.warmup_s) for name, t in traces.items()}
    if args.live:
        report["live"] = live_decisions()
    emit_report(report, args.json)
    if args.plot is not None:
        names = list(results)
        plot(args.plot, f"bench.routing: {args.trace.name}, {config.num_workers} workers", [
            ("hit ratio (share of prompt tokens)", "policy", {"hit ratio": ([*names, "oracle"], [*(results[n]["hit_ratio"] for n in names), oracle])}),
            ("TTFT p90 (s)", "policy", {"TTFT p90": (names, [results[n]["ttft_s_p90"] for n in names])}),
        ], bars=True, logy=True)
    return 0


def _replay_policies(trace, policies, config, policy_config, warmup_s) -> dict[str, dict]:
    results = {}
    for name in policies:
        progress("routing", f"{name}: replaying {len(trace)} requests on {config.num_workers} workers")
        start = time.perf_counter()
        results[name] = Replay(trace, name, config, policy_config, warmup_s).run()
        results[name]["replay_wall_s"] = round(time.perf_counter() - start, 2)
        progress("routing", f"{name}: hit ratio {results[name]['hit_ratio']:.3f}, TTFT p90 {results[name]['ttft_s_p90']:.3f} s")
    return results


def _summary(oracle: float, results: dict[str, dict]) -> dict:
    """Per policy the issue's three numbers, and the goals: one trace shape's row."""
    keep = ("hit_ratio", "load_max_over_mean", "ttft_s_p90", "prefill_busy_share", "decide_us_p99_32k")
    return {
        "oracle_hit_ratio": oracle,
        "policies": {n: {**{k: r[k] for k in keep}, "hit_ratio_over_oracle": r["hit_ratio"] / oracle if oracle else None} for n, r in results.items()},
        "goals": evaluate_goals(oracle, results),
    }


def _sensitivity(trace, config, policy_config, warmup_s) -> dict:
    """splitserve's hit ratio, load and TTFT p90 with each parameter of SENSITIVITY x0.5 and x2."""
    oracle = oracle_hit_ratio(trace, warmup_s=warmup_s)
    table = {}
    for name in SENSITIVITY:
        table[name] = {}
        for factor in (0.5, 2.0):
            varied = dataclasses.replace(policy_config, **{name: getattr(policy_config, name) * factor})
            progress("routing", f"sensitivity: {name} x{factor}")
            r = Replay(trace, "splitserve", config, varied, warmup_s).run()
            table[name][f"x{factor:g}"] = {"hit_ratio_over_oracle": r["hit_ratio"] / oracle if oracle else None, "load_max_over_mean": r["load_max_over_mean"], "ttft_s_p90": r["ttft_s_p90"]}
    return table


def live_decisions(num_workers: int = 8, block_size: int = 16, prompt_tokens: int = 32768, num_sessions: int = 16, num_turns: int = 20, seed: int = 0) -> dict:
    """Wall-clock time of ``GenerationService.route``, the routing step every Generate call runs
    on the router's event loop (token ids to block keys, the prefix index, the splitserve policy),
    in process: one router, ``num_workers`` prefill replicas whose KV events (the chosen worker
    stores the prompt's blocks) reach the index between calls, as the event poller applies them.
    Sessions open at ``prompt_tokens`` (their first call hashes every block: "cold") and each turn
    adds an answer and a message (100-800 tokens). ``decide_cpu_us_*``: the same steps in this
    thread's CPU time, which a machine shared with other work inflates less than wall-clock.
    ``settle_us_*``: the index learning the decision (``PrefixIndex.settle``), which the router
    runs after sending the request, off its path (wall-clock). Each figure is given over every
    decision, the first turns and the next turns."""
    rng = random.Random(seed)
    namespace = KeyNamespace("bench", "0", "fp8_e4m3", block_size)
    model = pb.ModelInfo(id="bench", max_model_len=4 * prompt_tokens, block_size=block_size)
    directory = WorkerDirectory()
    for i in range(num_workers + 1):
        pool = "decode" if i == num_workers else "prefill"
        status = pb.ReplicaStatus(replica_id=f"{pool}-{i}", pool=pool, healthy=True, num_kv_blocks=4096, num_free_kv_blocks=2048)
        directory.replicas[status.replica_id] = Replica(None, model, status, namespace=namespace)
    index = PrefixIndex()
    service = GenerationService(RouterConfig(), directory, RouterMetrics("bench-live"), make_policy("splitserve", index), channels=None)
    prefills, decode = directory.healthy("prefill", ""), directory.replicas[f"decode-{num_workers}"]
    sessions = [[rng.randrange(50_000) for _ in range(prompt_tokens)] for _ in range(num_sessions)]
    gc.collect()  # the sessions' token lists are this bench's, not the router's: the first young-generation pass, in a timed decision, would walk their 500k ids (~3 ms)
    wall_us, cpu_us, settle_us, lengths = {"first": [], "next": []}, {"first": [], "next": []}, {"first": [], "next": []}, []
    for turn in range(num_turns):
        for prompt in sessions:
            request = pb.GenerateRequest(model="bench", prompt_token_ids=prompt, request_id=f"t{turn}")
            lengths.append(len(prompt))
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            chosen = service.route(request, prefills, decode)
            wall_us["first" if turn == 0 else "next"].append((time.perf_counter_ns() - start) / 1000)
            cpu_us["first" if turn == 0 else "next"].append((time.thread_time_ns() - start_cpu) / 1000)
            start = time.perf_counter_ns()
            index.settle()  # what the router's loop runs once the request is sent
            settle_us["first" if turn == 0 else "next"].append((time.perf_counter_ns() - start) / 1000)
            keys = block_keys(prompt, block_size, namespace.root_key())  # what the worker's KV events say
            for replica in prefills:  # the refresh loop's load reports (they expire old remembered keys)
                service.policy.report(worker_load(replica))
            index.apply(KVEventBatch(chosen.replica_id, index.seq(chosen.replica_id) + 1 if chosen.replica_id in index.workers else 1, (KVEvent(EventKind.STORED, Tier.POOL, tuple(keys)),)))
            prompt += [rng.randrange(50_000) for _ in range(rng.randrange(100, 800))]
    figures = {}
    for clock, times in (("decide_us", wall_us), ("decide_cpu_us", cpu_us), ("settle_us", settle_us)):
        for group, values in (("", times["first"] + times["next"]), ("_first_turns", times["first"]), ("_next_turns", times["next"])):
            for q in (50, 99):
                figures[f"{clock}_p{q}{group}"] = percentile(values, q)
    return {
        **figures,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "workers": num_workers,
        "block_size": block_size,
        "num_decisions": len(lengths),
        "num_first_turns": len(wall_us["first"]),
        "code_path": "router.frontend.service.GenerationService.route in process (the step Generate runs after tokenizing)",
        "native_chain": NATIVE_CHAIN,
    }


def _read(path: Path, warmup_s: float) -> list[TraceRequest]:
    """The trace at ``path``, or a BenchError saying why it cannot be replayed."""
    if not path.is_file():
        raise BenchError(f"--trace {path}: no such file")
    try:
        trace = read_trace(path)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError too
        raise BenchError(f"--trace {path} is not a Mooncake JSONL trace: {e}") from None
    if not trace or trace[-1].timestamp_ms - trace[0].timestamp_ms < warmup_s * 1000:
        raise BenchError(f"--trace {path}: no request comes after the {warmup_s} s warm-up (--warmup-s)")
    return trace


if __name__ == "__main__":
    sys.exit(run("routing", main))
