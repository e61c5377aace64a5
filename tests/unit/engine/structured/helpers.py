"""Reading masks and driving matchers in the structured-output tests."""

from __future__ import annotations

import numpy as np
import torch

from engine.structured.bitmask import allocate_bitmask
from engine.structured.matcher import GrammarMatcher
from engine.tokenizer import Tokenizer

EOS = 2
"""SmolLM2's <|im_end|>, its only EOS."""


def allowed_ids(row: torch.Tensor) -> np.ndarray:
    """The token ids a bitmask row allows, ascending."""
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))


def mask_of(matcher: GrammarMatcher) -> np.ndarray:
    """The token ids ``matcher`` allows next."""
    bitmask = allocate_bitmask(1, matcher.num_mask_words * 32)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_ids(bitmask[0])


def accept_text(matcher: GrammarMatcher, tokenizer: Tokenizer, text: str) -> list[int]:
    """Accept ``text``'s tokens one by one, asserting each is accepted; returns them."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for token_id in token_ids:
        assert matcher.accept(token_id), (text, tokenizer.decode([token_id]))
    return token_ids
