"""A step's allowed-token masks, filled on a helper thread while the forward pass runs.

    engine thread:  start(chunks) ─► forward pass ──────────► logits ─► masks.result() ─► sample
    helper thread:          └─► fill each constrained row ─┘   (llguidance drops the GIL)

Only the engine thread advances matchers (``Request.append_token``), and only after the step's
masks are in: a matcher is never used by both threads at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.structured.bitmask import allocate_bitmask, fill_bitmasks
from engine.structured.verify import verify_drafts


class StepMasks:
    """Starts the fill of one step's masks: one ``int32 [1 + drafts, words]`` bitmask per
    constrained request that samples (row j: the mask after its drafts 0..j-1)."""

    def __init__(self, vocab_size: int) -> None:
        """Built with the engine's grammar backend, at its first constrained request (off the
        engine thread): the batched fill's import (``llguidance.torch``, ~1.3 CPU-s: it compiles a
        kernel) is paid here, not by every engine process at start nor by a step."""
        importlib.import_module("llguidance.torch")

        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def start(self, chunks: Sequence) -> Future | None:
        """The masks of ``chunks``' constrained requests that sample this step, being filled;
        None when no such request runs."""
        todo = [(c.request, tuple(c.draft_token_ids)) for c in chunks if c.samples and c.request.grammar is not None]
        if not todo:
            return None
        return self._pool.submit(self._fill, todo, self.vocab_size)

    @staticmethod
    def _fill(todo: list, vocab_size: int) -> dict:
        bitmask = allocate_bitmask(sum(1 + len(drafts) for _, drafts in todo), vocab_size)
        plain, out, row = [], {}, 0
        for request, drafts in todo:
            if drafts:
                verify_drafts(request.grammar, drafts, bitmask, row)
            else:
                plain.append((request.grammar, row))
            out[request] = bitmask[row : row + 1 + len(drafts)]
            row += 1 + len(drafts)
        fill_bitmasks(plain, bitmask)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def masks_of(masks: Future | dict | None) -> dict[object, torch.Tensor]:
    """A step's masks by request, waiting for their fill to end."""
    if masks is None:
        return {}
    return masks.result() if isinstance(masks, Future) else masks
