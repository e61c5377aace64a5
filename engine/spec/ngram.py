"""Prompt-lookup drafting: guess what follows by finding the sequence's own tail earlier on."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], num_drafts: int, min_match: int, max_match: int) -> list[int]:
    """Up to ``num_drafts`` tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, trying n from ``max_match`` down to ``min_match``; [] when none matches.

    The latest occurrence is taken because an answer that copies a passage copies it in
    order: the most recent match is the one the copy is in the middle of.
    """
    num_tokens = len(token_ids)
    if num_drafts < 1:
        return []
    for n in range(min(max_match, num_tokens - 1), min_match - 1, -1):
        tail = list(token_ids[num_tokens - n :])
        last = tail[-1]
        for end in range(num_tokens - 2, n - 2, -1):  # ``end``: where a match's last token sits
            if token_ids[end] == last and list(token_ids[end - n + 1 : end + 1]) == tail:
                return list(token_ids[end + 1 : end + 1 + num_drafts])
    return []
