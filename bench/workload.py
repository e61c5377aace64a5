"""Seeded synthetic workloads shared by the benchmarks."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: random prompt tokens and an exact output length (EOS ignored)."""

    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int


def random_workload(
    num_requests: int,
    prompt_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    num_special_tokens: int,
    seed: int,
) -> list[BenchRequest]:
    """Prompt and output lengths uniform over their inclusive ranges; token ids skip special tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        prompt = tuple(rng.randrange(num_special_tokens, vocab_size) for _ in range(prompt_len))
        out.append(BenchRequest(prompt, rng.randint(*output_len_range)))
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def emit_report(report: dict, path: Path | None) -> None:
    """Print the report as JSON and, given a path, write it there too."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
