"""Trace replay of cache-aware routing: the real prefix index and policies against simulated workers.

    python -m bench.routing --trace FILE --workers 8 --json OUT [--policies ...] [cluster flags]

Replays a Mooncake-format trace (bench/traces.py) once per policy through the simulated cluster
of bench/routing_sim.py (its docstring has the model and the H100 / Llama-3-70B-FP8 defaults),
and reports, per policy, hit ratios per tier, load balance, TTFT percentiles and the wall-clock
time of the real ``policy.choose`` calls, beside the trace's oracle hit ratio and the goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from bench.routing_sim import BLOCK_TOKENS, ClusterConfig, Replay, oracle_hit_ratio
from bench.traces import describe, read_trace
from bench.workload import emit_report
from router.cli_args import add_dataclass_args, dataclass_from_args
from router.routing import POLICIES, PolicyConfig

__all__ = ["BLOCK_TOKENS", "ClusterConfig", "Replay", "evaluate_goals", "main", "oracle_hit_ratio"]


def evaluate_goals(oracle: float, results: dict[str, dict]) -> dict:
    """The issue's goals for ``splitserve``, each with its value and whether it is met."""
    ours = results.get("splitserve")
    if ours is None:
        return {}
    baselines = {name: r["ttft_s_p90"] for name, r in results.items() if name != "splitserve"}
    ratio = ours["hit_ratio"] / oracle if oracle else None
    goals = {
        "hit_ratio_over_oracle": {"target": ">= 0.9", "value": ratio, "met": ratio is not None and ratio >= 0.9},
        "load_max_over_mean": {"target": "<= 1.15", "value": ours["load_max_over_mean"], "met": ours["load_max_over_mean"] <= 1.15},
        "ttft_s_p90_below_every_baseline": {
            "target": "< " + (f"{min(baselines.values()):.3f} ({min(baselines, key=baselines.get)})" if baselines else "no baseline run"),
            "value": ours["ttft_s_p90"],
            "met": bool(baselines) and all(ours["ttft_s_p90"] < v for v in baselines.values()),
        },
    }
    value = ours["decide_us_p99_32k"]
    goals["decide_us_p99_32k"] = {"target": "<= 500", "value": value, "met": None if value is None else value <= 500}
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=ClusterConfig.num_workers, help="prefill workers")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--warmup-s", type=float, default=180.0, help="requests before this time warm the cluster and are not counted (default: 180)")
    add_dataclass_args(parser, ClusterConfig, skip=("num_workers",))
    add_dataclass_args(parser, PolicyConfig, prefix="splitserve")
    args = parser.parse_args(argv)
    config = dataclass_from_args(ClusterConfig, args, num_workers=args.workers)
    policy_config = dataclass_from_args(PolicyConfig, args, prefix="splitserve")
    trace = read_trace(args.trace)
    results = {}
    for name in args.policies:
        start = time.perf_counter()
        results[name] = Replay(trace, name, config, policy_config, args.warmup_s).run()
        results[name]["replay_wall_s"] = round(time.perf_counter() - start, 2)
        print(f"{name}: hit {results[name]['hit_ratio']:.3f}, ttft p90 {results[name]['ttft_s_p90']:.3f} s ({results[name]['replay_wall_s']} s)", file=sys.stderr)
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
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
