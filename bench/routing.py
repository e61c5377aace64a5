"""Trace replay of cache-aware routing: the real prefix index and policies against simulated workers.

    python -m bench.routing --trace FILE [--generate mixed|multiturn|agent] --json OUT --plot OUT.png

With ``--generate`` a seeded trace (bench/traces.py) is written to FILE first. The trace is
replayed once per policy through the simulated cluster of bench/routing_sim.py (its docstring
has the model and its H100 defaults); per policy: hit ratios per tier, load balance, TTFT
percentiles and the wall-clock time of the real ``policy.choose`` calls, beside the trace's
oracle hit ratio and the goals.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from bench.report import BenchError, arg_parser, emit_report, machine, plot, positive, progress, run
from bench.routing_sim import ClusterConfig, Replay, oracle_hit_ratio
from bench.traces import KINDS, TraceConfig, TraceRequest, describe, generate, read_trace, write_trace
from router.cli_args import add_dataclass_args, dataclass_from_args
from router.routing import POLICIES, PolicyConfig


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
        "hit_ratio_over_oracle": {"target": ">= 0.9", "value": ratio, "met": ratio is not None and ratio >= 0.9},
        "load_max_over_mean": {"target": "<= 1.15", "value": load, "met": load <= 1.15},
        "ttft_s_p90_below_every_baseline": {
            "target": f"< {baselines[best]:.3f} ({best})" if best else "< no baseline run",
            "value": ttft,
            "met": best is not None and ttft < baselines[best],
        },
        "decide_us_p99_32k": {"target": "<= 500", "value": decide, "met": None if decide is None else decide <= 500},
    }


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False, plot="hit ratio and TTFT p90 per policy")
    parser.add_argument("--trace", type=Path, required=True, help="a Mooncake JSONL trace (with --generate: written first)")
    parser.add_argument("--generate", choices=KINDS, help="write a seeded trace of this kind to --trace, then replay it")
    parser.add_argument("--requests", type=positive, default=20000, help="requests of a generated trace (default: 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace (default: 0)")
    parser.add_argument("--workers", type=int, default=ClusterConfig.num_workers, help="prefill workers")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--warmup-s", type=float, default=180.0, help="requests before this time warm the cluster and are not counted (default: 180)")
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
    if args.generate:
        progress("routing", f"generating a {args.generate} trace of {args.requests} requests (seed {args.seed}) into {args.trace}")
        write_trace(generate(args.generate, args.requests, args.seed, trace_config), args.trace)
    trace = _read(args.trace, args.warmup_s)
    results = {}
    for name in args.policies:
        progress("routing", f"{name}: replaying {len(trace)} requests on {config.num_workers} workers")
        start = time.perf_counter()
        results[name] = Replay(trace, name, config, policy_config, args.warmup_s).run()
        results[name]["replay_wall_s"] = round(time.perf_counter() - start, 2)
        progress("routing", f"{name}: hit ratio {results[name]['hit_ratio']:.3f}, TTFT p90 {results[name]['ttft_s_p90']:.3f} s")
    oracle = oracle_hit_ratio(trace, warmup_s=args.warmup_s)
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
    emit_report(report, args.json)
    if args.plot is not None:
        names = list(results)
        plot(args.plot, f"bench.routing: {args.trace.name}, {config.num_workers} workers", [
            ("hit ratio (share of prompt tokens)", "policy", {"hit ratio": ([*names, "oracle"], [*(results[n]["hit_ratio"] for n in names), oracle])}),
            ("TTFT p90 (s)", "policy", {"TTFT p90": (names, [results[n]["ttft_s_p90"] for n in names])}),
        ], bars=True, logy=True)
    return 0


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
