"""Turn one row of logits per sequence into one token per sequence.

Sampling is counter-based: the draw for a request's n-th output token comes from a generator
seeded with ``step_seed(seed, n)``, never from state carried between steps. So a seeded request
samples the same tokens whatever else is in the batch, whichever worker samples which token (a
prefill worker the first, a decode worker the rest), and after a restart from any point (a
request migrated to another replica with the tokens streamed so far).

The logits arrive processed (``engine/logits.py``: logit bias, min_tokens, penalties, a
constraint's mask; banned tokens at -inf, which no filter below keeps), and the runner reads the
rows' log-probabilities from the same tensor, so they describe what was drawn from.
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
    ``i`` drawing with ``step_seed(seeds[i], positions[i])`` (``positions``: output tokens so far).

    Only rows with a filter are ranked, and only as far as needed: ``topk`` of the largest k
    asked for, a full sort only for a top-p row without a top-k. A plain temperature row draws
    from the whole softmax. (A full sort of a 49k vocabulary costs about a millisecond per row,
    and a verify step samples ``1 + k`` rows per sequence.)
    """
    tokens = logits.argmax(dim=-1).tolist()
    plain = [i for i, p in enumerate(params) if not p.is_greedy and p.top_k == 0 and p.top_p >= 1]
    filtered = [i for i, p in enumerate(params) if not p.is_greedy and (p.top_k > 0 or p.top_p < 1)]
    if plain:
        probs = torch.softmax(logits[plain] / _temperatures(params, plain, logits.device)[:, None], dim=-1)
        for i, pick in zip(plain, _draw(probs, plain, seeds, positions)):
            tokens[i] = pick
    if filtered:
        probs, ranked_ids = _filtered_probs(logits, params, filtered)
        ranks = _draw(probs, filtered, seeds, positions)
        for j, (i, rank) in enumerate(zip(filtered, ranks)):
            tokens[i] = int(ranked_ids[j, rank])
    return tokens


def _temperatures(params: list[SamplingParams], rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=device)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities of ``rows`` over their best tokens in rank order (top-k and top-p applied), and those tokens' ids."""
    vocab = logits.shape[-1]
    # A top_k beyond the vocabulary keeps every token (as 0 does): topk cannot rank more than there are.
    device = logits.device
    top_k = [min(params[i].top_k or vocab, vocab) for i in rows]
    width = max(top_k)
    ranked_logits, ranked_ids = torch.topk(logits[rows] / _temperatures(params, rows, device)[:, None], width, dim=-1)
    ranked_logits.masked_fill_(torch.arange(width, device=device)[None, :] >= torch.tensor(top_k, device=device)[:, None], float("-inf"))
    probs = torch.softmax(ranked_logits, dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    return probs, ranked_ids


def _draw(probs: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int]) -> list[int]:
    """One column of each row of ``probs``, row ``j`` with the counter-based seed of ``rows[j]``
    (drawn on the CPU whatever the device: the same seed gives the same token everywhere)."""
    probs = probs.cpu()
    generator = torch.Generator()
    picks = []
    for j, i in enumerate(rows):
        generator.manual_seed(step_seed(seeds[i], positions[i]))
        picks.append(torch.multinomial(probs[j], 1, generator=generator))
    return torch.cat(picks).tolist()
