"""What no planner that saves can promise: a trace that turns on the planner's own shrinks.

    python -m bench.planner_adversary [--set dev|outside] [--traces NAME ...] [--seed-offset K] [--policies splitserve hpa] [--rounds N] --json OUT

A planner (or HPA) decides from the load it has seen, never from the load to come. Replay it on a
trace and take the first interval in which it puts a pool below the deployment (the static split it
started from). From that moment on, splice into the trace a copy of the trace's own busiest stretch
that the deployment served within its SLOs (``--stretch-s`` long; default a reaction: a start-up and
an interval, the time any policy needs to have a replica back), and move the rest of the trace
later by as much. Every arrival before the shrink is the same, so the policy's decisions up to it
are the same too (``same_until_shrink``, checked, not assumed); the deployment serves the copy as it
served the stretch the first time; the shrunk pool meets it a reaction short. Repeated at the
policy's next shrink, up to ``--rounds`` times, until the issue's attainment target (static's less
0.01) no longer holds.

Per trace and policy the report gives each splice, the attainment of a static split of the
deployment and of the policy before and after (and the policy's replica-hours over static's), and
whether the target held before (``target_held_before``) and after (``target_broken``); ``summary``
counts the traces on which the policy saved (went below the deployment at all), those of them on
which it met the target before the splices, and those of these on which the target broke.
A policy that never goes below its deployment leaves the adversary nothing to turn on, and saves
nothing: the point is that "never worse than static on any trace" and "fewer replica-hours than
static" exclude each other for any policy that only sees the past (planner/README.md, Evaluation).
"""

from __future__ import annotations

import bisect
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

from bench.planner import DEFAULT_PERF, parse_with_planner_config, replay
from bench.planner_sets import SETS, chosen, draw
from bench.planner_sim import Simulation
from bench.planner_traces import Arrival
from bench.report import arg_parser, emit_report, machine, progress, run
from planner.config import PlannerConfig
from planner.connector import POOLS
from planner.perf_model import load_splitwise_csv

TARGET_SLACK = 0.01
"""The issue's attainment target: a policy's attainment at least static's less this much."""


def served_within_slo(trace: list[Arrival], perf, config: PlannerConfig, split: tuple[int, int]) -> list[bool]:
    """Per request of ``trace``, whether a static split ``split`` (prefill, decode) served it within both SLOs."""
    sim = Simulation(trace, perf, config, lambda *_: None, split)
    sim.run()
    return sim.within_slo(*sim.latencies())


def busiest_served_stretch(trace: list[Arrival], met: list[bool], length_s: float, attainment: float) -> tuple[float, int]:
    """(start, requests) of the ``length_s`` stretch of ``trace`` with the most arrivals of which at
    least ``attainment`` were served within the SLOs (``met``): load the deployment carries."""
    times = [a.time_s for a in trace]
    met_before = [0]
    for ok in met:
        met_before.append(met_before[-1] + ok)
    best = (trace[0].time_s, 0)
    for first, start_s in enumerate(times):
        end = bisect.bisect_left(times, start_s + length_s, lo=first)
        n = end - first
        if n > best[1] and met_before[end] - met_before[first] >= attainment * n:
            best = (start_s, n)
    return best


def splice(trace: list[Arrival], at_s: float, stretch_start_s: float, length_s: float) -> list[Arrival]:
    """``trace`` with a copy of its arrivals in [stretch_start_s, stretch_start_s + length_s) moved to
    begin at ``at_s``, and its own arrivals from ``at_s`` on moved ``length_s`` later."""
    before = [a for a in trace if a.time_s < at_s]
    copy = [a._replace(time_s=at_s + a.time_s - stretch_start_s) for a in trace if stretch_start_s <= a.time_s < stretch_start_s + length_s]
    after = [a._replace(time_s=a.time_s + length_s) for a in trace if a.time_s >= at_s]
    return before + sorted(copy) + after


def first_shrink(timeline: list[tuple], deployment: dict[str, int], after_s: float) -> tuple[float, str, int] | None:
    """(time, pool, replicas) of the first row of ``timeline`` after ``after_s`` with a pool below its deployment."""
    for row in timeline:
        if row[0] <= after_s:
            continue
        for k, pool in enumerate(POOLS):
            if row[2 + k] < deployment[pool]:
                return row[0], pool, row[2 + k]
    return None


def attack(trace: list[Arrival], perf, config: PlannerConfig, policy: str, static: dict, stretch: dict, rounds: int) -> dict:
    """Splices the deployment's busiest served stretch (``stretch``: its start, length and requests)
    in at ``policy``'s shrinks (one a round) until its attainment falls below static's less
    ``TARGET_SLACK`` on the spliced trace, or it shrinks no more."""
    split = (static["split"]["prefill"], static["split"]["decode"])
    stretch_start_s, stretch_s = stretch["start_s"], stretch["length_s"]
    ours, timeline = replay(trace, perf, config, policy, static=static)
    entry = {"before": {"static": static["slo_attainment"], policy: ours["slo_attainment"], f"{policy}_replica_hours_over_static": ours["replica_hours"] / static["replica_hours"]}, "splices": []}
    entry["stretch"] = dict(stretch)
    spliced, after_s, same = trace, -1.0, True
    for _ in range(rounds):
        shrink = first_shrink(timeline, static["split"], after_s)
        if shrink is None:
            break
        at_s, pool, replicas = shrink
        # Both arrivals and the policy's own tick at ``at_s`` stay before the copy: it arrives just after.
        spliced = splice(spliced, at_s + 1e-3, stretch_start_s, stretch_s)
        previous = timeline
        ours, timeline = replay(spliced, perf, config, policy, static=static)
        same = same and [row[2:] for row in previous if row[0] <= at_s] == [row[2:] for row in timeline if row[0] <= at_s]
        static_now = Simulation(spliced, perf, config, lambda *_: None, split).run()
        entry["splices"].append({"at_s": at_s, "pool": pool, "replicas": replicas, "deployment": static["split"][pool], "static": static_now["slo_attainment"],
                                 policy: ours["slo_attainment"], f"{policy}_replica_hours_over_static": ours["replica_hours"] / static_now["replica_hours"]})
        after_s = at_s + stretch_s
        if ours["slo_attainment"] < static_now["slo_attainment"] - TARGET_SLACK:
            break
    entry["saved"] = bool(entry["splices"])
    entry["same_until_shrink"] = same
    entry["after"] = {k: v for k, v in entry["splices"][-1].items() if k in entry["before"]} if entry["splices"] else dict(entry["before"])
    entry["target_held_before"] = entry["before"][policy] >= entry["before"]["static"] - TARGET_SLACK
    entry["target_broken"] = entry["after"][policy] < entry["after"]["static"] - TARGET_SLACK
    return entry


def attack_trace(name: str, config: PlannerConfig, policies: tuple[str, ...], seed_offset: int, trace_set: str, scale: int, stretch_s: float, rounds: int) -> dict:
    """Each of ``policies`` attacked on one trace of ``trace_set``, against the cheapest static split."""
    perf = load_splitwise_csv(DEFAULT_PERF, "llama2-70b", "h100-80gb", 4)
    trace = draw(trace_set, name, config.startup_s, seed_offset, scale)
    static, _ = replay(trace, perf, config, "static")
    # The same stretch for every policy: the deployment's, found once.
    met = served_within_slo(trace, perf, config, (static["split"]["prefill"], static["split"]["decode"]))
    start_s, requests = busiest_served_stretch(trace, met, stretch_s, config.attainment_target)
    stretch = {"start_s": start_s, "length_s": stretch_s, "requests": requests}
    return {"deployment": static["split"], "policies": {policy: attack(trace, perf, config, policy, static, stretch, rounds) for policy in policies}}


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False)
    parser.add_argument("--set", dest="trace_set", choices=list(SETS), default="dev", help="dev: the development set; outside: shapes kept apart as a check (default: dev)")
    names = [name for make in SETS.values() for name in make()]
    parser.add_argument("--traces", nargs="+", choices=names, help="traces of the set to attack (default: all of it)")
    parser.add_argument("--policies", nargs="+", choices=("splitserve", "hpa"), default=["splitserve", "hpa"], help="policies attacked, each on its own shrinks (default: both)")
    parser.add_argument("--seed-offset", type=int, default=0, help="draw the generated traces from seeds shifted by this much (default: 0)")
    parser.add_argument("--scale", type=int, default=1, help="superpose this many draws of each generated trace (default: 1)")
    parser.add_argument("--stretch-s", type=float, help="length of the stretch spliced in at a shrink (default: a start-up and an interval)")
    parser.add_argument("--rounds", type=int, default=5, help="shrinks spliced at most, one after another (default: 5)")
    parser.add_argument("--jobs", type=int, default=2, help="traces attacked at once, one process each (default: 2)")
    args, config = parse_with_planner_config(parser, argv)
    for flag, value in (("--jobs", args.jobs), ("--rounds", args.rounds), ("--scale", args.scale)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    stretch_s = config.startup_s + config.interval_s if args.stretch_s is None else args.stretch_s
    if not stretch_s > 0:
        parser.error(f"--stretch-s must be above 0, got {args.stretch_s}")
    try:
        args.traces = chosen(args.trace_set, args.traces, args.scale)
    except ValueError as e:
        parser.error(str(e))
    policies = tuple(dict.fromkeys(args.policies))
    progress("planner_adversary", f"{len(args.traces)} traces x {', '.join(policies)}, a {stretch_s:g} s stretch at up to {args.rounds} shrinks, on {args.jobs} processes")
    # Spawned, not forked, as bench.planner_devset's workers.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(attack_trace, name, config, policies, args.seed_offset, args.trace_set, args.scale, stretch_s, args.rounds) for name in args.traces}
        traces = {}
        for name, future in futures.items():
            traces[name] = future.result()
            progress("planner_adversary", f"{name}: " + ", ".join(
                f"{p} {e['before'][p]:.4f} -> {e['after'][p]:.4f} against static's {e['after']['static']:.4f} after {len(e['splices'])} splices"
                f"{' (target broken)' if e['target_broken'] else ''}" for p, e in traces[name]["policies"].items()))
    entries = {p: [t["policies"][p] for t in traces.values()] for p in policies}
    summary = {p: {"traces": len(traces), "saved": sum(e["saved"] for e in es),
                   "saved_within_target": sum(e["saved"] and e["target_held_before"] for e in es),
                   "broken_of_those": sum(e["saved"] and e["target_held_before"] and e["target_broken"] for e in es),
                   "same_until_shrink": all(e["same_until_shrink"] for e in es)} for p, es in entries.items()}
    report = {"traces": traces, "summary": summary, "set": args.trace_set, "seed_offset": args.seed_offset, "scale": args.scale,
              "stretch_s": stretch_s, "rounds": args.rounds, "planner_config": vars(config), "machine": machine()}
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run("planner_adversary", main))
