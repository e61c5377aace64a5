"""What every bench shares at its edges: progress lines, the JSON report, plots, and clean exits."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class BenchError(Exception):
    """A problem the user can fix (bad input, a cluster that is not up): one sentence, exit 2."""


@contextlib.contextmanager
def user_error(*errors: type[Exception], prefix: str = ""):
    """Inside, any of ``errors`` (what the user can fix: a model that is not there, a size it
    cannot serve) becomes a BenchError saying the same sentence, after ``prefix``."""
    try:
        yield
    except errors as e:
        raise BenchError(f"{prefix}{e}") from None


def run(name: str, main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """``main(argv)``, with a BenchError printed as ``bench.NAME: sentence`` and exit status 2."""
    try:
        return main(argv)
    except BenchError as e:
        print(f"bench.{name}: {e}", file=sys.stderr, flush=True)
        return 2


def arg_parser(doc: str, model: bool = True, plot: str | None = None) -> argparse.ArgumentParser:
    """A bench's parser: ``doc`` as its help, ``--json PATH``, ``--model`` unless ``model`` is
    False, and ``--plot PATH`` where ``plot`` says what the PNG shows."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the report here as well as to stdout")
    if model:
        parser.add_argument("--model", default="smollm2-135m", help="bundled model name or checkpoint directory (default: smollm2-135m)")
    if plot is not None:
        parser.add_argument("--plot", type=Path, help=f"write {plot} here (PNG)")
    return parser


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1, or the option's error naming what was given."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Each ``MIN MAX`` option in ``names`` (dests, e.g. ``prompt_len``) has MIN <= MAX, or the parser's error naming it."""
    for name in names:
        low, high = getattr(args, name)
        if low > high:
            parser.error(f"--{name.replace('_', '-')}: MIN is above MAX")


def progress(name: str, message: str) -> None:
    """One line on stderr per phase, so a long run never looks hung."""
    print(f"[bench.{name} {datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
"""The CPU features that pick the engine's kernel paths (and llama.cpp's): the same model name
("AMD EPYC") covers AVX2-only and AVX-512 parts, whose figures differ by a third."""


def machine() -> dict:
    """Where a report was measured: date, CPU model and its SIMD features, cores usable, torch threads."""
    import torch

    info = _cpuinfo()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": model,
        "cpu_flags": [flag for flag in SIMD_FLAGS if flag in flags],
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median_s(fn: Callable[[], object], repetitions: int) -> float:
    """Median wall-clock seconds of ``repetitions`` calls of ``fn``, after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def emit_report(report: dict, path: Path | None) -> None:
    """Print the report as JSON and, given a path, write it there too."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


Series = dict[str, tuple[Sequence[float], Sequence[float]]]
"""A panel's lines: label -> (x values, y values)."""


def series(rows: Sequence[dict], key: str, label: Callable[[dict], str]) -> Series:
    """One line per ``label(row)`` of ``row[key]`` over ``row["concurrency"]``; rows with one label and one concurrency are averaged."""
    points: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        points.setdefault(label(row), {}).setdefault(row["concurrency"], []).append(row[key])
    return {name: (sorted(p), [statistics.fmean(p[k]) for k in sorted(p)]) for name, p in points.items()}


def plot(path: Path, title: str, panels: Sequence[tuple[str, str, Series]], bars: bool = False, logx: bool = False, logy: bool = False) -> None:
    """A row of panels (y label, x label, series), as lines over x (a log2 axis with ``logx``, log10 y with ``logy``) or,
    with ``bars``, as grouped bars over category labels (x values are then the categories),
    written to ``path`` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (ylabel, xlabel, series) in zip(axes[0], panels):
        for i, (label, (xs, ys)) in enumerate(series.items()):
            if bars:
                width = 0.8 / len(series)
                ax.bar([j + i * width for j in range(len(xs))], ys, width, label=label)
                ax.set_xticks([j + 0.4 - width / 2 for j in range(len(xs))], [str(x) for x in xs], rotation=20, ha="right")
            else:
                ax.plot(xs, ys, marker="o", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
