"""Checking speculative drafts against a grammar before the target model verifies them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured.matcher import GrammarMatcher


def verify_drafts(matcher: GrammarMatcher, draft_token_ids: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
    """Fill the masks of the k+1 positions a draft of k tokens is verified at, and return how many
    leading drafts the grammar accepts.

        row:    first_row     +1          +2      ...   +k
        mask:   before d0     after d0    after d1      after d(k-1)   (the bonus position)

    Drafts are accepted tentatively and rolled back before it returns: the matcher ends where it
    started, and the engine then ``accept``s the tokens it keeps. When draft i is refused, row i
    holds the mask at that position (the engine samples its replacement there) and rows i+1..k
    allow every token: they are never sampled from, and a row of all -inf would make NaN.
    ``bitmask`` needs rows ``first_row .. first_row + k``.
    """
    num_accepted = 0
    for token_id in draft_token_ids:
        matcher.fill_bitmask(bitmask, first_row + num_accepted)
        if not matcher.accept(token_id):
            break
        num_accepted += 1
    else:
        matcher.fill_bitmask(bitmask, first_row + num_accepted)
    bitmask[first_row + num_accepted + 1 : first_row + len(draft_token_ids) + 1] = -1
    matcher.rollback(num_accepted)
    return num_accepted
