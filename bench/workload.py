"""Seeded synthetic workloads shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

NUM_SPECIAL_TOKENS = 32
"""Prompt token ids start above this, clear of SmolLM2's control tokens (ids 0-16)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: random prompt tokens and an exact output length (EOS ignored)."""

    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int


def random_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int) -> list[BenchRequest]:
    """Prompt and output lengths uniform over their inclusive ranges; token ids skip special tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt = tuple(rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(rng.randint(*prompt_len)))
        out.append(BenchRequest(prompt, rng.randint(*output_len)))
    return out


def variant(workload: list[BenchRequest], tag: int) -> list[BenchRequest]:
    """The same lengths with new prompts: the first token becomes ``tag``, so every block key
    (each chains from the first block) differs from any other variant's."""
    return [replace(r, prompt_token_ids=(tag,) + r.prompt_token_ids[1:]) for r in workload]
