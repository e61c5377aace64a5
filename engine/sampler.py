"""Turn one row of logits per sequence into one token per sequence.

Sampling is counter-based: the draw for a request's n-th output token comes from a generator
seeded with ``step_seed(seed, n)``, never from state carried between steps. So a seeded request
samples the same tokens whatever else is in the batch, whichever worker samples which token (a
prefill worker the first, a decode worker the rest), and after a restart from any point (a
request migrated to another replica with the tokens streamed so far).
"""

from __future__ import annotations

import torch

from engine.params import SamplingParams

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """The generator seed of output token ``position`` of a request seeded with ``seed``
    (splitmix64 of the pair, so neighbouring positions draw unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are signed 64-bit


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """Greedy rows take the argmax; the others sample after temperature, top-k and top-p, row
    ``i`` drawing with ``step_seed(seeds[i], positions[i])`` (``positions``: output tokens so far)."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return tokens
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
    sorted_logits, sorted_ids = torch.sort(logits[rows] / temperature[:, None], dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab)
    top_k = torch.tensor([params[i].top_k or vocab for i in rows])
    sorted_logits.masked_fill_(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    generator = torch.Generator()
    for j, i in enumerate(rows):
        generator.manual_seed(step_seed(seeds[i], positions[i]))
        pick = torch.multinomial(probs[j], 1, generator=generator)
        tokens[i] = int(sorted_ids[j, pick])
    return tokens
