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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.e2e import GOAL_TTFT_ADDED_MS, t_ci95
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
    return {
        "file": str(path),
        "engine_cpus": report.get("engine_cpus"),
        "rounds": len(added["mean_by_round"]),
        "added_ms_mean": added["mean"],
        "added_ms_by_round": added["mean_by_round"],
        "serving_path_ms_mean": (open_loop.get("ttft_ms_added_mean_split") or {}).get("serving_path"),
        "engine_step_time_added": engine.get("step_time_added"),
    }


def pool(runs: list[dict]) -> dict:
    run_means = [r["added_ms_mean"] for r in runs]
    rounds = [x for r in runs for x in r["added_ms_by_round"]]
    paths = [r["serving_path_ms_mean"] for r in runs if r["serving_path_ms_mean"] is not None]
    over_runs = {"num_runs": len(runs), "mean": round(statistics.fmean(run_means), 2), "ci95": t_ci95(run_means)}
    return {
        "runs": runs,
        "over_runs": over_runs,
        "over_rounds": {"num_rounds": len(rounds), "mean": round(statistics.fmean(rounds), 2), "ci95": t_ci95(rounds)},
        "serving_path_ms_mean_over_runs": round(statistics.fmean(paths), 2) if paths else None,
        "goal_ttft_added_ms": GOAL_TTFT_ADDED_MS,
        "mean_within_goal": over_runs["mean"] <= GOAL_TTFT_ADDED_MS,
        "ci95_within_goal": over_runs["ci95"] is not None and over_runs["ci95"][1] <= GOAL_TTFT_ADDED_MS,
    }


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
