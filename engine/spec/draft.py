"""Draft-model drafting: a small model of the same vocabulary guesses the next k tokens greedily.

The draft model keeps a KV cache of its own (blocks from a private ``BlockPool``) and remembers,
per request, which tokens that cache holds. Each step it first catches up with the sequence
(the tokens accepted since its last proposal: usually one or two, a whole prompt the first
time) in one batched pass that also yields the first draft, then runs one batched decode pass
per further draft. Drafts it guessed wrong are simply forgotten: the next catch-up starts
where its tokens and the sequence's part ways::

    its tokens:  [ t0 ... t40 d0 d1 d2 ]        sequence: [ t0 ... t40 d0 x ]
    kept:        [ t0 ... t40 d0 ]              catch-up:              [ x ] -> next draft
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_cache import PagedKVCache
from engine.models.decoder import DecoderModel
from engine.request import Request
from engine.runner import ModelRunner
from engine.step_plan import PlannedChunk, StepPlan
from kv_store.block_pool import BlockPool


@dataclass
class _DraftState:
    token_ids: list[int] = field(default_factory=list)
    """Tokens whose K/V the draft cache holds, from position 0."""
    block_ids: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts from ``model`` over a KV pool of its own."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache) -> None:
        self.runner = ModelRunner(model, kv_cache)
        self.pool = BlockPool(kv_cache.num_blocks, enable_caching=False)
        self.block_size = kv_cache.layout.block_size
        self._states: dict[Request, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        chunks = {}
        for index, request in enumerate(requests):
            chunk = self._catch_up(request)
            if chunk is not None:
                chunks[index] = chunk
        for round_ in range(max(num_drafts, default=0)):
            if not chunks:
                break
            tokens = self._run(list(chunks.values()))
            next_chunks = {}
            for (index, chunk), token in zip(chunks.items(), tokens):
                drafts[index].append(token)
                if round_ + 1 < num_drafts[index]:
                    following = self._extend(requests[index], token)
                    if following is not None:
                        next_chunks[index] = following
            chunks = next_chunks
        return drafts

    def forget(self, request: Request) -> None:
        state = self._states.pop(request, None)
        if state is not None:
            self.pool.release(reversed(state.block_ids))

    def _catch_up(self, request: Request) -> PlannedChunk | None:
        """The chunk that brings the draft cache level with ``request`` (at least its last token)."""
        state = self._states.setdefault(request, _DraftState())
        kept = 0
        limit = min(len(state.token_ids), request.num_tokens - 1)
        while kept < limit and state.token_ids[kept] == request.token_ids[kept]:
            kept += 1
        del state.token_ids[kept:]
        return self._chunk(request, state, request.token_ids[kept:])

    def _extend(self, request: Request, token: int) -> PlannedChunk | None:
        state = self._states.get(request)
        return self._chunk(request, state, [token]) if state is not None else None

    def _chunk(self, request: Request, state: _DraftState, new_token_ids: list[int]) -> PlannedChunk | None:
        """Blocks for ``new_token_ids`` after ``state.token_ids``; None (and the request's state
        dropped) when the draft pool has too few free blocks."""
        start = len(state.token_ids)
        end = start + len(new_token_ids)
        needed = -(-end // self.block_size)
        if needed < len(state.block_ids):
            self.pool.release(reversed(state.block_ids[needed:]))
            del state.block_ids[needed:]
        elif needed > len(state.block_ids):
            fresh = self.pool.allocate(needed - len(state.block_ids))
            if fresh is None:
                self.forget(request)
                return None
            state.block_ids += fresh
        state.token_ids += new_token_ids
        return PlannedChunk(start=start, num_tokens=len(new_token_ids), token_ids=tuple(new_token_ids), block_ids=tuple(state.block_ids))

    def _run(self, chunks: list[PlannedChunk]) -> list[int]:
        """One batched pass over ``chunks``; the argmax after each chunk's last token, in order."""
        decodes = sorted((i for i, c in enumerate(chunks) if c.num_tokens == 1), key=lambda i: chunks[i].start)
        prefills = [i for i, c in enumerate(chunks) if c.num_tokens > 1]
        rows, row_of, num_tokens = [], {}, 0
        for i in decodes + prefills:
            num_tokens += chunks[i].num_tokens
            row_of[i] = len(rows)
            rows.append(num_tokens - 1)
        plan = StepPlan(decodes=tuple(chunks[i] for i in decodes), prefills=tuple(chunks[i] for i in prefills), sample_rows=tuple(rows))
        best = self.runner.run(plan).argmax(dim=-1).tolist()
        return [best[row_of[i]] for i in range(len(chunks))]
