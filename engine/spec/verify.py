"""Acceptance of verified drafts.

A verify step samples every one of its ``1 + k`` rows with the engine's own sampler: row j is
output token ``n + j`` of the request and draws with ``step_seed(seed, n + j)``, exactly as plain
decoding would. Draft j is accepted when row j's sample equals it; the first row whose sample
differs gives the correction token, and when every draft is accepted the last row gives the
bonus token.

For a one-hot draft distribution q (a copied token, or a draft model's argmax) this *is*
rejection sampling: the draft x is accepted with probability p(x) = min(1, p(x) / q(x)), and on
rejection the token is distributed as p restricted to tokens other than x, renormalised, which
is ``normalize(max(0, p - q))``. It is also exactly what plain decoding samples, token for token,
for greedy and seeded requests alike: speculation changes how many forward passes a request
takes, never its output.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(draft_token_ids: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts the target's samples (one per verified row, ``len(drafts) + 1``) accept."""
    if len(sampled) != len(draft_token_ids) + 1:
        raise ValueError(f"sampled: {len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} samples, got {len(sampled)}")
    for index, (draft, token) in enumerate(zip(draft_token_ids, sampled)):
        if draft != token:
            return index
    return len(draft_token_ids)
