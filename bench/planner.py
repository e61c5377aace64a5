"""Trace replay of the SLA planner: the real SLAPlanner against a static split and an HPA rule.

    python -m bench.planner --trace FILE [--generate bursty|DEV_TRACE] --json OUT --plot OUT.png

A trace is a CSV with a header (Azure LLM 2023/2024 ``TIMESTAMP,ContextTokens,GeneratedTokens``,
BurstGPT's ``Timestamp,...,Request tokens,Response tokens,...``, or any columns naming an arrival
time and prompt and output tokens) or JSON lines ending in ``.jsonl`` (Mooncake's ``timestamp`` in
ms, ``input_length``, ``output_length``; or ``arrival_time``, ``prompt_tokens``, ...); ``.gz`` too.
With ``--generate bursty`` a seeded trace is written to FILE first: Poisson arrivals on a base rate
with smooth bursts of long prompts, of long outputs, of both, and quiet spells; ``--generate NAME`` writes the development set's trace NAME (bench/planner_traces.py). The replay is a discrete-event simulation of the two pools whose costs come from
the perf model (planner/perf_model.py; default the Splitwise llama2-70b H100 TP 4 rows) in
bench/planner_sim.py; the traces and the development set's generators are bench/planner_traces.py.
The dynamic policies start from the static split, as a planner (or HPA) turned on over a running
deployment does. When no static split reaches the attainment target, the bar becomes the best
attainment a split reaches, reported as such (``attainment_bar``, ``target_reached``), and every
policy is judged against it; requests no replica count serves in time are counted in ``trace_stats``.
``hindsight`` (bench/hindsight.py) is the cheapest prefill schedule chosen knowing the whole trace:
what the trace allows.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from bench.hindsight import replay_hindsight
from bench.planner_sim import HPA, Simulation
from bench.planner_sets import dev_set
from bench.planner_traces import Arrival, generate_bursty, read_arrivals, write_csv
from bench.report import BenchError, arg_parser, emit_report, machine, progress, run
from cli.args import add_dataclass_args, dataclass_from_args
from planner.config import PlannerConfig
from planner.connector import POOLS
from planner.perf_model import DEFAULT_PERF_MODEL, load_profile, load_splitwise_csv
from planner.policy import SLAPlanner

__all__ = ["Arrival", "DEFAULT_PERF", "PlannerConfig", "Simulation", "generate_bursty", "load_splitwise_csv", "main", "read_arrivals", "replay", "write_csv"]

STATIC_SLACK = 0.001
"""When no static split reaches the attainment target, the bar is the best attainment any split
reaches less this much: past enough replicas, each added one buys only a straggler or two."""
DEFAULT_PERF = DEFAULT_PERF_MODEL


def replay(trace, perf, config, policy, cost_scale=1.0, static=None) -> tuple[dict, list]:
    """``policy``'s result and timeline on ``trace`` (replicas start in ``config.startup_s``). ``static``
    searches the cheapest split reaching ``config.attainment_target``; the others start from static's
    split (replayed unless given), as a planner or HPA turned on over a running deployment does;
    ``hindsight`` (bench/hindsight.py) keeps static's decode count and bar."""
    sim = lambda controller, initial: Simulation(trace, perf, config, controller, initial, cost_scale)  # noqa: E731
    if policy == "static":
        return cheapest_static(sim, config)
    static = static or cheapest_static(sim, config)[0]
    if policy == "hindsight":
        return replay_hindsight(trace, perf, config, static, sim, cost_scale)
    start = (static["split"]["prefill"], static["split"]["decode"])
    if policy == "hpa":
        s = sim(HPA(config), start)
        return s.run(), s.timeline
    planner, infeasible, infeasible_requests = SLAPlanner(config, perf), [], [0]

    def controller(now, observation, pools, use):
        decision = planner.decide(observation, pools)
        infeasible.extend(decision.infeasible)
        infeasible_requests[0] += decision.infeasible_requests
        return dict(decision.targets)

    s = sim(controller, start)
    result = s.run()
    result.update(infeasible_intervals=len(infeasible), infeasible_requests=infeasible_requests[0], final_corrections=planner.corrections)
    return result, s.timeline


def cheapest_static(sim, config) -> tuple[dict, list]:
    """The static split with the fewest replicas reaching the attainment target, the more attaining
    of equals; when none up to max_prefill + max_decode does, the bar becomes the best attainment
    a split reaches (the one at the maximum, less ``STATIC_SLACK``), and the cheapest split reaching
    that. Attainment grows with either count, so the fewest of each pool alone (with the other at
    its maximum) bound the search from below."""
    replays = {}

    def attained(prefill: int, decode: int) -> float:
        if (prefill, decode) not in replays:
            s = sim(lambda *_: None, (prefill, decode))
            replays[prefill, decode] = (s.run(), s.timeline)
        return replays[prefill, decode][0]["slo_attainment"]

    best = attained(config.max_prefill, config.max_decode)
    bar = min(config.attainment_target, best - STATIC_SLACK)

    def fewest(at_least: int, most: int, attains) -> int:  # the fewest n in [at_least, most] with attains(n)
        while at_least < most:
            mid = (at_least + most) // 2
            at_least, most = (at_least, mid) if attains(mid) else (mid + 1, most)
        return at_least

    low_prefill = fewest(0, config.max_prefill, lambda n: attained(n, config.max_decode) >= bar)
    low_decode = fewest(1, config.max_decode, lambda n: attained(config.max_prefill, n) >= bar)
    for total in range(low_prefill + low_decode, config.max_prefill + config.max_decode + 1):
        splits = [(p, total - p) for p in range(low_prefill, config.max_prefill + 1) if low_decode <= total - p <= config.max_decode]
        reaching = [split for split in splits if attained(*split) >= bar]
        if reaching:
            split = max(reaching, key=lambda split: attained(*split))
            result, timeline = replays[split]
            result.update(split={"prefill": split[0], "decode": split[1]}, splits_tried=len(replays), attainment_bar=bar,
                          target_reached=bar == config.attainment_target, best_attainment=best)
            return result, timeline
    raise AssertionError("the split at the maximum reaches its own attainment")


MAX_CHANGES_PER_HOUR = 12
"""The most direction changes per hour a pool may make (the issue's bound on flapping): over the
trace's mean and in its busiest hour."""


def evaluate_goals(results: dict, span_s: float) -> dict:
    """The issue's targets for ``splitserve`` against ``static``, each with whether it is met."""
    ours, static = results.get("splitserve"), results.get("static")
    if not (ours and static):
        return {}
    hours = ours["replica_hours"] / static["replica_hours"]
    # The mean over the trace, or the busiest hour where that is more (a long trace's mean hides an hour of flapping).
    mean = max(ours["direction_changes_per_pool"].values()) / (span_s / 3600)
    per_hour = max([mean, *ours.get("direction_changes_busiest_hour", {}).values()])
    return {
        "attainment_within_0.01_of_static": {"target": f">= {static['slo_attainment'] - 0.01:.4f}", "value": ours["slo_attainment"], "met": ours["slo_attainment"] >= static["slo_attainment"] - 0.01},
        "replica_hours_over_static": {"target": "<= 1.0 (goal 0.8 on bursty traces)", "value": hours, "met": hours <= 1.0},
        "direction_changes_per_hour_per_pool": {"target": f"<= {MAX_CHANGES_PER_HOUR}", "value": per_hour, "met": per_hour <= MAX_CHANGES_PER_HOUR},
    }


def describe(trace, perf, config, cost_scale: float = 1.0) -> dict:
    """The trace in a few numbers, with the requests no replica count serves within the TTFT SLO (a
    prompt whose prefill alone takes longer) counted apart."""
    span_s = trace[-1].time_s
    longest = perf.longest_prompt(config.ttft_slo_s / cost_scale)  # the planner's own test of a prompt
    infeasible = sum(a.prompt_tokens > longest for a in trace)
    return {"num_requests": len(trace), "span_s": span_s, "request_rate": len(trace) / span_s,
            "prompt_tokens_mean": sum(a.prompt_tokens for a in trace) / len(trace), "output_tokens_mean": sum(a.output_tokens for a in trace) / len(trace),
            "infeasible_requests": infeasible, "infeasible_share": infeasible / len(trace), "mostly_infeasible": infeasible > len(trace) / 2}


def parse_with_planner_config(parser, argv: list[str] | None):
    """(args, PlannerConfig) from ``parser`` with every PlannerConfig field added as an option; a bad value is a usage error."""
    add_dataclass_args(parser, PlannerConfig)
    args = parser.parse_args(argv)
    try:
        return args, dataclass_from_args(PlannerConfig, args)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False, plot="arrival rate and each policy's replicas over time")
    parser.add_argument("--trace", type=Path, required=True, help="CSV (Azure LLM, BurstGPT, any header naming an arrival time, prompt and output tokens) or JSON lines (Mooncake, ...), .gz too; with --generate: written first, as CSV")
    parser.add_argument("--generate", choices=("bursty", *dev_set()), help="write a generated trace to --trace, then replay it: bursty (seeded by --seed, --duration-s long) or a development-set trace (fixed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace (default: 0)")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="length of a generated trace (default: 3600)")
    parser.add_argument("--perf-model", type=Path, default=DEFAULT_PERF, help="Splitwise CSV or profile JSON (default: planner/data/splitwise_perf_model.csv)")
    parser.add_argument("--perf-rows", nargs=3, default=["llama2-70b", "h100-80gb", "4"], metavar=("MODEL", "HARDWARE", "TP"), help="Splitwise row set (default: llama2-70b h100-80gb 4)")
    parser.add_argument("--cost-scale", type=float, default=1.0, help="simulated costs over the perf model's (the planner's correction must find it; default: 1)")
    parser.add_argument("--policies", nargs="+", choices=("splitserve", "static", "hpa", "hindsight"), default=["splitserve", "static", "hpa"], help="hindsight: the cheapest prefill schedule knowing the whole trace (default: the first three)")
    args, config = parse_with_planner_config(parser, argv)
    if args.cost_scale <= 0:
        parser.error("--cost-scale must be above 0")
    try:
        perf = load_profile(args.perf_model) if args.perf_model.suffix == ".json" else load_splitwise_csv(args.perf_model, args.perf_rows[0], args.perf_rows[1], int(args.perf_rows[2]))
    except (OSError, ValueError) as e:
        raise BenchError(f"--perf-model {args.perf_model}: {e}") from None
    if args.generate == "bursty":
        progress("planner", f"generating a bursty trace of {args.duration_s:.0f} s (seed {args.seed}) into {args.trace}")
        write_csv(generate_bursty(args.seed, args.duration_s), args.trace)
    elif args.generate:
        progress("planner", f"writing the development set's {args.generate} trace into {args.trace}")
        write_csv(dev_set(config.startup_s)[args.generate](), args.trace)
    trace = read_arrivals(args.trace)
    results, timelines = {}, {}
    for name in sorted(args.policies, key=lambda name: name != "static"):  # the others start from static's split
        progress("planner", f"{name}: replaying {len(trace)} requests over {trace[-1].time_s:.0f} s")
        results[name], timelines[name] = replay(trace, perf, config, name, args.cost_scale, results.get("static"))
        r = results[name]
        progress("planner", f"{name}: attainment {r['slo_attainment']:.4f}, {r['replica_hours']:.2f} replica-hours, {r['direction_changes']} direction changes")
    stats = describe(trace, perf, config, args.cost_scale)
    if stats["mostly_infeasible"]:
        progress("planner", f"{stats['infeasible_requests']} of {len(trace)} requests have prompts no replica prefills within the TTFT SLO of {config.ttft_slo_s} s")
    report = {
        "trace": str(args.trace),
        "trace_stats": stats,
        "perf_model": perf.source,
        "cost_scale": args.cost_scale,
        "planner_config": dataclasses.asdict(config),
        "policies": results,
        "goals": evaluate_goals(results, stats["span_s"]),
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
