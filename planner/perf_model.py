"""What one replica costs: prefill seconds by prompt length and decode ITL by batch size.

Two sources, one shape. ``load_splitwise_csv`` reads the Splitwise artifact
(``planner/data/splitwise_perf_model.csv``, a copy of ``../shared/data``'s): prefill from its batch-1 rows (``prompt_time`` by
``prompt_size``), decode from its 512-token-prompt rows (``token_time`` by ``batch_size``), repeats
averaged. ``load_profile`` reads what ``python -m planner.profile`` writes on a live cluster::

    {"source": "smollm2-135m on ...",
     "prefill": [[prompt_tokens, prefill_s], ...],
     "decode": [[batch_size, itl_s], ...]}

Between points the model interpolates linearly; past the last point it extends the last segment
(decode is memory-bound, so ITL keeps growing about linearly with the batch); below the first
point it holds the first value (a fixed per-step cost). ITL does not depend on context here: the
Splitwise rows at batch 1 with 128 to 8,192 generated tokens differ by under 5%.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PERF_MODEL = Path(__file__).resolve().parent / "data" / "splitwise_perf_model.csv"
"""The bundled Splitwise perf model (planner/data/README.md): what `splitserve plan` and bench.planner load by default."""

Points = tuple[tuple[float, float], ...]


def _interpolate(points: Points, x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0] or len(points) == 1:
        return points[0][1] if x <= xs[0] else points[-1][1]
    i = min(len(points) - 1, bisect.bisect_left(xs, x))
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _points(name: str, rows: Sequence[Sequence[float]]) -> Points:
    try:
        points = tuple(sorted((float(x), float(y)) for x, y in rows))
    except (TypeError, ValueError):
        raise ValueError(f"{name}: every point must be a pair of numbers.") from None
    if not points or any(x <= 0 or y <= 0 or not math.isfinite(x) or not math.isfinite(y) for x, y in points):
        raise ValueError(f"{name}: needs at least one point, every value above 0.")
    if len({x for x, _ in points}) != len(points):
        raise ValueError(f"{name}: two points share an x value.")
    return points


@dataclass(frozen=True)
class PerfModel:
    """Per-replica costs, fitted by piecewise-linear interpolation of profiled points."""

    prefill: Points
    """(prompt_tokens, prefill_s) of one prompt alone on one replica, sorted by tokens."""
    decode: Points
    """(batch_size, itl_s): seconds per decode step of a batch this size, sorted by batch."""
    source: str = ""
    """Where the points came from."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", _points("prefill", self.prefill))
        object.__setattr__(self, "decode", _points("decode", self.decode))

    def prefill_s(self, prompt_tokens: float) -> float:
        """Seconds one replica takes to prefill a prompt of this length."""
        return _interpolate(self.prefill, prompt_tokens)

    def itl_s(self, batch_size: float) -> float:
        """Seconds per token of each sequence when one replica decodes ``batch_size`` of them."""
        return _interpolate(self.decode, max(1.0, batch_size))

    def largest_batch(self, itl_s: float, max_batch: int) -> int:
        """The largest batch (<= ``max_batch``) whose ITL is at most ``itl_s``; 0 when even one
        sequence is slower."""
        low, high = 0, max_batch
        while low < high:
            mid = (low + high + 1) // 2
            if self.itl_s(mid) <= itl_s:
                low = mid
            else:
                high = mid - 1
        return low

    def longest_prompt(self, seconds: float) -> float:
        """The longest prompt (tokens) one replica prefills within ``seconds``; 0 when not even one
        token, inf when any length (prefill time is taken to grow with length)."""
        low, high = 0.0, 1e9
        if self.prefill_s(high) <= seconds:
            return math.inf
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if self.prefill_s(mid) <= seconds else (low, mid)
        return low

    def to_profile(self) -> dict:
        """The JSON shape ``load_profile`` reads."""
        return {"source": self.source, "prefill": [list(p) for p in self.prefill], "decode": [list(p) for p in self.decode]}


def load_profile(path: Path) -> PerfModel:
    """A profile JSON (see the module docstring); ValueError saying what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
        return PerfModel(data["prefill"], data["decode"], str(data.get("source", path)))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a profile with 'prefill' and 'decode' point lists ({type(e).__name__}: {e}).") from None


def load_splitwise_csv(path: Path, model: str = "llama2-70b", hardware: str = "h100-80gb", tensor_parallel: int = 4) -> PerfModel:
    """One model/hardware/TP row set of the Splitwise CSV; ValueError when it has none."""
    prefill: dict[float, list[float]] = defaultdict(list)
    decode: dict[float, list[float]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if (row["model"], row["hardware"], int(row["tensor_parallel"])) != (model, hardware, tensor_parallel):
                continue
            if int(row["batch_size"]) == 1:
                prefill[float(row["prompt_size"])].append(float(row["prompt_time"]) / 1000)
            if int(row["prompt_size"]) == 512:
                decode[float(row["batch_size"])].append(float(row["token_time"]) / 1000)
    if not prefill or not decode:
        raise ValueError(f"{path} has no rows for {model} on {hardware} at TP {tensor_parallel}.")
    mean = lambda d: [(x, sum(v) / len(v)) for x, v in d.items()]  # noqa: E731
    return PerfModel(mean(prefill), mean(decode), f"splitwise {model} {hardware} TP{tensor_parallel}")
