"""Turn one row of logits per sequence into one token per sequence."""

from __future__ import annotations

import torch

from engine.params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Greedy rows take the argmax; the others sample after temperature, top-k and top-p.

    Each row draws from its own generator, so a seeded request gets the same tokens whatever
    else is in the batch.
    """
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
    for j, i in enumerate(rows):
        pick = torch.multinomial(probs[j], 1, generator=generators[i])
        tokens[i] = int(sorted_ids[j, pick])
    return tokens
