"""The planner's development set replayed at once: every trace of bench/planner_sets.dev_set under every policy.

    python -m bench.planner_devset [--set dev|outside] [--traces NAME ...] [--policies ...] [--seed-offset K] [--jobs N] --json OUT [--table]

Prints one JSON report: per trace its stats (with the requests no replica count can serve within
the TTFT SLO counted apart), each policy's attainment, replica-hours, direction changes per pool,
and the issue's goals for ``splitserve`` against the static split; ``summary`` counts the traces
that meet each goal. ``--table`` also writes the markdown table planner/README.md carries to stderr.
Planner settings are the ones ``bench.planner`` takes (``--startup-s`` also sizes the bursts).
``--seed-offset K`` draws the generated traces from seeds shifted by K: the same shapes, held out
from development (names keep the development set's; the recorded conv traces do not change).
``--scale N`` superposes N draws of each generated trace (seeds shifted by a further 0, 1000, ...):
the same shapes at N times the load, as from N times the users (the recorded conv traces are left
out). ``--set outside`` replays instead the shapes kept apart from development as a check
(bench/planner_sets.outside_set: a load after an idle stretch, a sawtooth, a step down, long
answers, a trickle, periodic bursts, and more added since).
"""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

from bench.planner import DEFAULT_PERF, describe, evaluate_goals, parse_with_planner_config, replay
from bench.planner_sets import SETS, chosen, draw
from bench.report import arg_parser, emit_report, machine, progress, run
from planner.config import PlannerConfig
from planner.perf_model import load_splitwise_csv

POLICIES = ("splitserve", "static", "hpa", "hindsight")
SUMMARY_FIELDS = ("slo_attainment", "replica_hours", "direction_changes_per_pool", "direction_changes_busiest_hour", "infeasible_intervals", "split", "attainment_bar", "target_reached", "best_attainment", "reached_target", "infeasible_requests")


def replay_trace(name: str, config: PlannerConfig, policies: tuple[str, ...], seed_offset: int = 0, trace_set: str = "dev", scale: int = 1) -> dict:
    """One trace of ``trace_set`` under ``policies`` (static first: hindsight starts from it)."""
    perf = load_splitwise_csv(DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = draw(trace_set, name, config.startup_s, seed_offset, scale)
    results = {}
    for policy in sorted(policies, key=lambda p: p != "static"):
        result, _ = replay(trace, perf, config, policy, static=results.get("static"))
        results[policy] = {k: v for k, v in result.items() if k in SUMMARY_FIELDS}
    stats = describe(trace, perf, config)
    return {"trace_stats": stats, "policies": {p: results[p] for p in policies if p in results}, "goals": evaluate_goals(results, stats["span_s"])}


def table(report: dict) -> str:
    """The markdown table: per trace and policy, attainment, replica-hours over static's, and direction changes per pool."""
    lines = ["| trace | policy | SLO attainment | replica-hours (x static) | direction changes (prefill + decode) |", "|---|---|---|---|---|"]
    for name, entry in report["traces"].items():
        static = entry["policies"].get("static")
        for policy, r in entry["policies"].items():
            ratio = f" ({r['replica_hours'] / static['replica_hours']:.2f}x)" if static else ""
            changes = r["direction_changes_per_pool"]
            split = f" {r['split']['prefill']} + {r['split']['decode']}" if "split" in r else ""
            lines.append(f"| {name} | {policy}{split} | {r['slo_attainment']:.4f} | {r['replica_hours']:.2f}{ratio} | {changes['prefill']} + {changes['decode']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False)
    parser.add_argument("--set", dest="trace_set", choices=list(SETS), default="dev", help="dev: the development set; outside: shapes kept apart as a check (default: dev)")
    names = [name for make in SETS.values() for name in make()]
    parser.add_argument("--traces", nargs="+", choices=names, help="traces of the set to replay (default: all of it)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=["splitserve", "static", "hpa"], help="(default: splitserve static hpa)")
    parser.add_argument("--seed-offset", type=int, default=0, help="draw the generated traces from seeds shifted by this much: held-out traces of the same shapes (default: 0, the development set)")
    parser.add_argument("--scale", type=int, default=1, help="superpose this many draws of each generated trace (seeds shifted by a further 0, 1000, ...): the same shapes at this many times the load (default: 1)")
    parser.add_argument("--jobs", type=int, default=2, help="traces replayed at once, one process each (default: 2)")
    parser.add_argument("--table", action="store_true", help="also write the markdown table to stderr")
    args, config = parse_with_planner_config(parser, argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.scale < 1:
        parser.error(f"--scale must be at least 1, got {args.scale}")
    try:
        args.traces = chosen(args.trace_set, args.traces, args.scale)
    except ValueError as e:
        parser.error(str(e))
    policies = tuple(dict.fromkeys(["static", *args.policies]))  # every other policy starts from static's split
    progress("planner_devset", f"{len(args.traces)} traces x {', '.join(policies)} on {args.jobs} processes")
    # Spawned, not forked: a caller's threads (a Ray driver's, gRPC's) do not survive a fork, and a
    # forked worker of a process that runs them can abort mid-replay.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(replay_trace, name, config, policies, args.seed_offset, args.trace_set, args.scale) for name in args.traces}
        traces = {}
        for name, future in futures.items():
            traces[name] = future.result()
            goals = traces[name]["goals"]
            progress("planner_devset", f"{name}: " + ", ".join(f"{k} {v['value']:.3f}{'' if v['met'] else ' (missed)'}" for k, v in goals.items()))
    met = {goal: sum(t["goals"].get(goal, {}).get("met", False) for t in traces.values()) for goal in next(iter(traces.values()))["goals"]}
    report = {"traces": traces, "summary": {"num_traces": len(traces), "goals_met": met}, "set": args.trace_set, "seed_offset": args.seed_offset, "scale": args.scale, "planner_config": vars(config), "machine": machine()}
    emit_report(report, args.json)
    if args.table:
        print(table(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run("planner_devset", main))
