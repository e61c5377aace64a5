"""Pool saved bench.e2e reports of the open-loop protocol, one run as one sample.

    python -m bench.e2e_pool bench/results/e2e_n8_pinned*.json bench/results/e2e_n8_client*.json

Runs nothing: it reads reports that ``python -m bench.e2e --json`` wrote. Each report's open-loop
rounds pair the gRPC run with the in-process runs either side (``ttft_ms_added_vs_bracket``).
Rounds of one run share its processes: one decode worker and one in-process engine, each with
its own memory layout, and their relative speed can hold for a whole run (``engine_vs_bracket``:
in one run the worker's steps took 1.2-2.2% less time than the in-process engine's in every
round; in the others the difference stayed within 0.7%). Rounds of a run then are not
independent samples of what the serving path adds, and an interval over pooled rounds may be too
narrow. This reports both: the mean of the runs' means with a Student's t interval over runs,
and the pooled rounds with theirs, beside each run's mean, rounds, serving-path mean and
engine step-time difference.

Over runs, it also splits what is added into its measured parts, each with its own t interval:
the serving path (hops: the client's TTFT minus the worker's own, request by request), the
worker's side (the rest), and what the serving stack takes from the engine (its step time, its
thread's CPU time and its waits inside steps, against the in-process engine over the same
tokens). Beside them stands the A/A control: the in-process engine against itself on one
schedule, a difference that no serving path is in.

``power`` says what an end-to-end verdict would take here. A request's paired difference has a
standard deviation of tens of ms (the step phase it catches, the prompts that share its step),
back-calculated from each run's bootstrap interval; the runs' means scatter by their standard
deviation. It gives the runs (and hours, at the runs' mean wall time) that would narrow the t
interval over runs to the gap between the goal and the serving path, the least an end-to-end
interval must resolve to tell a path within the goal from one past it.

``verdict`` judges the goal over the runs:

- ``serving_path_within_goal``: the serving path's t interval over runs ends at or below the
  goal. It is the time each request spends between the client and the worker's engine, measured
  request by request, so it needs no peer and its interval is narrow.
- ``engine_not_shown_slower``: the t interval over runs of the worker engine's step time against
  the in-process engine's, over the same tokens, reaches zero or below.
- ``end_to_end_within_goal``: the end-to-end estimate (the mean over runs) is at or below the
  goal. This is the one that holds everything the serving stack does to a first token, the
  hops and whatever it does to the worker's own time to first token.
- ``end_to_end_goal_excluded``: its t interval lies wholly above the goal.

``met`` needs the first three. Where the estimate is above the goal but the interval still
reaches it, the goal is neither met nor excluded, and ``power`` says how many more runs it would
take to tell.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.e2e import GOAL_TTFT_ADDED_MS, t_975, t_ci95
from bench.workload import emit_report


class NotAnOpenLoopReport(ValueError):
    """The file is not a bench.e2e report with open-loop rounds against the bracket."""


def read_run(path: Path) -> dict:
    """One report's open-loop summary; NotAnOpenLoopReport naming the file and what is missing."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NotAnOpenLoopReport(f"{path}: cannot read a JSON report ({e})") from e
    open_loop = report.get("open_loop") if isinstance(report, dict) else None
    added = (open_loop or {}).get("ttft_ms_added_vs_bracket")
    if not added or not added.get("mean_by_round"):
        raise NotAnOpenLoopReport(f"{path}: no open-loop rounds against the bracket (open_loop.ttft_ms_added_vs_bracket)")
    engine = open_loop.get("engine_vs_bracket") or {}
    serving_path = (open_loop.get("ttft_ms_added_mean_split") or {}).get("serving_path")
    stall = engine.get("stall_ms_per_step")
    control = open_loop.get("control_ttft_ms_paired")
    return {
        "file": str(path),
        "engine_cpus": report.get("engine_cpus"),
        "rounds": len(added["mean_by_round"]),
        "added_ms_mean": added["mean"],
        "added_ms_by_round": added["mean_by_round"],
        "serving_path_ms_mean": serving_path,
        "worker_side_ms_mean": round(added["mean"] - serving_path, 2) if serving_path is not None else None,
        "control_ms_mean": control["mean"] if control else None,
        "engine_step_time_added": engine.get("step_time_added"),
        "engine_cpu_time_added": engine.get("cpu_time_added"),
        "engine_stall_ms_per_step_added": round(stall["grpc"] - stall["peer"], 3) if stall else None,
        "per_request_sd_ms": _sd_from_ci(added),
        "wall_s": round(sum(row.get("wall_s", 0.0) for row in report.get("results") or []), 1) or None,
    }


def _sd_from_ci(paired: dict) -> float | None:
    """A request pair's standard deviation, from the report's bootstrap 95% interval of the mean
    over its ``num_pairs`` pairs (half-width = 1.96 sd / sqrt(n))."""
    ci, n = paired.get("mean_ci95"), paired.get("num_pairs")
    if not ci or not n:
        return None
    return round((ci[1] - ci[0]) / (2 * 1.96) * math.sqrt(n), 1)


def _over_runs(runs: list[dict], key: str, scale: float = 1.0) -> dict | None:
    """The runs' values of ``key`` (those that have it) times ``scale``: mean and t interval over runs."""
    values = [r[key] * scale for r in runs if r.get(key) is not None]
    if not values:
        return None
    return {"num_runs": len(values), "mean": round(statistics.fmean(values), 2), "ci95": t_ci95(values)}


def runs_needed(sd: float, margin: float) -> int | None:
    """The fewest runs n whose t interval, half-width t(n-1) sd / sqrt(n), is within ``margin``
    (None when the margin is not positive)."""
    if margin <= 0:
        return None
    n = 2
    while t_975(n - 1) * sd / math.sqrt(n) > margin:
        n += 1
    return n


def power(runs: list[dict], serving_path_ms: float | None) -> dict | None:
    """What an end-to-end verdict on this machine needs: see the module docstring."""
    run_means = [r["added_ms_mean"] for r in runs]
    sds = [r["per_request_sd_ms"] for r in runs if r["per_request_sd_ms"] is not None]
    if serving_path_ms is None or len(run_means) < 2:
        return None
    margin = GOAL_TTFT_ADDED_MS - serving_path_ms
    sd_runs = statistics.stdev(run_means)
    n = runs_needed(sd_runs, margin)
    walls = [r["wall_s"] for r in runs if r["wall_s"]]
    out = {
        "margin_ms": round(margin, 2),
        "run_mean_sd_ms": round(sd_runs, 2),
        "runs_needed": n,
        "hours_needed": round(n * statistics.fmean(walls) / 3600, 1) if n and walls else None,
    }
    if sds:
        sd = statistics.fmean(sds)
        out["per_request_sd_ms"] = round(sd, 1)
        out["request_pairs_needed"] = math.ceil((1.96 * sd / margin) ** 2) if margin > 0 else None
    return out


def pool(runs: list[dict]) -> dict:
    run_means = [r["added_ms_mean"] for r in runs]
    rounds = [x for r in runs for x in r["added_ms_by_round"]]
    over_runs = {"num_runs": len(runs), "mean": round(statistics.fmean(run_means), 2), "ci95": t_ci95(run_means)}
    split = {
        "serving_path_ms": _over_runs(runs, "serving_path_ms_mean"),
        "worker_side_ms": _over_runs(runs, "worker_side_ms_mean"),
        "control_ms": _over_runs(runs, "control_ms_mean"),
        "engine_step_time_added_pct": _over_runs(runs, "engine_step_time_added", 100),
        "engine_cpu_time_added_pct": _over_runs(runs, "engine_cpu_time_added", 100),
        "engine_stall_ms_per_step_added": _over_runs(runs, "engine_stall_ms_per_step_added"),
    }
    path_mean = split["serving_path_ms"]["mean"] if split["serving_path_ms"] else None
    return {
        "runs": runs,
        "over_runs": over_runs,
        "over_rounds": {"num_rounds": len(rounds), "mean": round(statistics.fmean(rounds), 2), "ci95": t_ci95(rounds)},
        "serving_path_ms_mean_over_runs": path_mean,
        "split_over_runs": split,
        "power": power(runs, path_mean),
        "goal_ttft_added_ms": GOAL_TTFT_ADDED_MS,
        "mean_within_goal": over_runs["mean"] <= GOAL_TTFT_ADDED_MS,
        "ci95_within_goal": over_runs["ci95"] is not None and over_runs["ci95"][1] <= GOAL_TTFT_ADDED_MS,
        "verdict": verdict(over_runs, split),
    }


def verdict(over_runs: dict, split: dict) -> dict:
    """See the module docstring; a part without an interval (fewer than two runs with it) fails."""
    path, engine, ci = split["serving_path_ms"], split["engine_step_time_added_pct"], over_runs["ci95"]
    out = {
        "serving_path_within_goal": bool(path and path["ci95"] and path["ci95"][1] <= GOAL_TTFT_ADDED_MS),
        "engine_not_shown_slower": bool(engine and engine["ci95"] and engine["ci95"][0] <= 0.0),
        "end_to_end_within_goal": over_runs["mean"] <= GOAL_TTFT_ADDED_MS,
        "end_to_end_goal_excluded": bool(ci and ci[0] > GOAL_TTFT_ADDED_MS),
    }
    return out | {"met": out["serving_path_within_goal"] and out["engine_not_shown_slower"] and out["end_to_end_within_goal"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+", help="bench.e2e JSON reports")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        runs = [read_run(path) for path in args.reports]
    except NotAnOpenLoopReport as e:
        print(f"bench.e2e_pool: {e}", file=sys.stderr)
        return 2
    emit_report(pool(runs), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
