"""Allowed-token bitmasks: one int32 row per sequence, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` may come next (llguidance's and xgrammar's layout).

    token id:   0 1 2 ... 31 | 32 33 ... 63 | ... | 32*(W-1) ... vocab_size-1 [padding bits]
    word:       ---- 0 ----- | ---- 1 ----- | ... | ------------ W-1 ----------------------
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import torch

from engine.structured.matcher import GrammarMatcher, check_bitmask

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 CPU bitmask of ``num_rows`` rows of ``ceil(vocab_size / 32)`` words, every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set ``logits[r, t]`` to -inf, in place, for each token ``t`` that ``bitmask[r]`` disallows.

    Row ``r`` of the bitmask belongs to row ``r`` of the logits; ``rows`` picks the rows to mask
    (None: all). Logits wider than the bitmask's bits are disallowed past them; padding bits past
    the logits' width are ignored. Batched torch ops on the logits' device, no loop over rows.
    """
    if rows is not None and len(rows) == 0:
        return
    num_rows, vocab_size = logits.shape
    words = bitmask if rows is None else bitmask[torch.as_tensor(rows, dtype=torch.long)]
    words = words.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1
    allowed = bits.view(words.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        allowed = allowed[:, :vocab_size]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def fill_bitmasks(matchers_with_rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """Fill ``bitmask[row]`` from each (matcher, row) pair, the rows computed in parallel on
    llguidance's own thread pool.

    llguidance drops the GIL while it computes masks, so calling this from a helper thread
    overlaps the forward pass on the engine thread. Measured (``bench.structured``, its ``gil``
    part, 2-core CPU): torch matmuls beside a thread filling 8 masks back to back took 1.0-1.8x
    their time alone (the two threads share two cores) while the fills kept their own rate;
    beside a thread running Python, 3.1-6.1x. Each matcher must not be used elsewhere until it
    returns.
    """
    if not matchers_with_rows:
        return
    check_bitmask(bitmask, matchers_with_rows[0][0].num_mask_words)
    if len(matchers_with_rows) == 1:
        matcher, row = matchers_with_rows[0]
        matcher.fill_bitmask(bitmask, row)
        return
    import llguidance.torch  # imported when StepMasks is built (engine/structured/step_masks.py): a lookup here

    pairs = [(matcher.ll_matcher, row) for matcher, row in matchers_with_rows]
    llguidance.torch.fill_next_token_bitmask_par(_executor(), pairs, bitmask)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()
