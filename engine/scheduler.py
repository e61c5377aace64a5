"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step spends a token budget: running sequences first (one token each in decode, the next
chunk of a prompt still being prefilled), then waiting ones in arrival order while blocks and
batch slots last. There is no separate prefill phase: a request just has ``num_tokens`` and
``num_computed_tokens``, and each step closes some of the gap::

    token_ids:  [ p0 p1 ... p40 | o0 o1 o2 ]          num_tokens = 44
    computed:   [ ==== cached ====|== computed ==|    ]  num_computed_tokens = 41
    this step:                                  [o1 o2]  num_new_tokens = 2 (after a preemption)

When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue with its
output so far, to be recomputed (its full blocks are usually still in the prefix cache).

A request whose prompt KV is computed elsewhere (disaggregated prefill) skips the queue: it is
*parked* with blocks for its whole prompt until the KV has been written into them, then joins the
running batch with its prompt computed and its first token already sampled::

    park_remote() -> parked (blocks held, nothing scheduled) -> join_remote(first_token) -> running
                                                              -> requeue_remote()      -> waiting (recompute)
                                                              -> abort()               -> dropped
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.request import Request
from kv_store.block_pool import BlockPool
from kv_store.tiered import TieredKVStore


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` from position ``start`` to compute this step."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so a next token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    """Decides which tokens of which requests run each step, and owns their blocks."""

    def __init__(
        self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, tiers: TieredKVStore | None = None
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        """Lower KV tiers that admission looks in after the pool (CPU, Redis)."""
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        """Requests waiting for their prompt KV from a prefill worker, by id."""
        self.leases: dict[str, list[int]] = {}
        """Blocks a KV transfer may still read or write, by request id: each holds one extra
        reference, so the block cannot be freed or reused until ``release_lease``."""
        self.num_preemptions = 0
        self.num_aborted = 0
        self.num_computed_prompt_tokens = 0
        """Prompt tokens whose K/V the engine computed (cache hits excluded); grows with recompute."""

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, waiting and running requests together."""
        queued = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        return queued + sum(r.num_prompt_tokens for r in self.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
                budget -= num_new
                index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            hits = self._take_prefix(request)
            request.block_ids = list(hits)
            request.num_registered_blocks = len(hits)
            request.num_computed_tokens = len(hits) * self.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new):
                self._release(request)
                break
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.waiting.popleft()
            self.running.append(request)
            if request.first_scheduled_s is None:
                request.first_scheduled_s = time.monotonic()
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return chunks

    def update(self, chunks: list[ScheduledChunk], sampled: dict[Request, int]) -> list[Request]:
        """Advance the scheduled requests, append sampled tokens; return the requests with new output."""
        touched = []
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            prompt_end = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens)
            self.num_computed_prompt_tokens += max(0, prompt_end - chunk.start)
            self._register_full_blocks(request)
            token = sampled.get(request)
            if token is None:
                continue
            request.append_token(token)
            touched.append(request)
            if request.finished:
                self.running.remove(request)
                if request.hold_kv:
                    self.lease(request.request_id, request.block_ids)
                self._release(request)
        return touched

    def lease(self, request_id: str, block_ids: list[int]) -> None:
        """Pin ``block_ids`` for a transfer until ``release_lease(request_id)``."""
        if request_id in self.leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        self.pool.acquire(block_ids)
        self.leases[request_id] = list(block_ids)

    def release_lease(self, request_id: str) -> bool:
        """End a transfer's lease; False if there was none."""
        block_ids = self.leases.pop(request_id, None)
        if block_ids is None:
            return False
        self.pool.release(reversed(block_ids))
        return True

    def park_remote(self, request: Request) -> list[int] | None:
        """Hold blocks for ``request``'s whole prompt, reusing its cached prefix; return the ids of
        the blocks the prompt's KV must be written into (those past the prefix), or None (and
        hold nothing) when too few blocks are free. Those blocks are also leased under the
        request's id: whatever becomes of the request, they stay out of the free queue until the
        transfer's owner calls ``release_lease``."""
        hits = self._take_prefix(request)
        request.block_ids = list(hits)
        needed = -(-request.num_prompt_tokens // self.block_size) - len(hits)
        fresh = self.pool.allocate(needed)
        if fresh is None:
            self._release(request)
            return None
        request.block_ids += fresh
        request.num_registered_blocks = len(hits)
        request.num_cached_tokens = len(hits) * self.block_size
        self.parked[request.request_id] = request
        self.lease(request.request_id, fresh)
        return fresh

    def join_remote(self, request: Request, first_token: int) -> None:
        """The prompt's KV has landed: mark it computed, cache its full blocks, append the token
        the prefill worker sampled and start decoding (or finish, if that token ends it)."""
        del self.parked[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        self.num_computed_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
        self._register_full_blocks(request)
        request.append_token(first_token)
        request.first_scheduled_s = request.first_scheduled_s or time.monotonic()
        if request.finished:
            self._release(request)
        else:
            self.running.append(request)

    def requeue_remote(self, request: Request) -> None:
        """Give up waiting for remote KV and prefill locally: free the request's blocks and queue
        it at the front (it has waited longest). To drop it instead, ``abort`` it."""
        del self.parked[request.request_id]
        self._release(request)
        request.num_cached_tokens = 0
        self.waiting.appendleft(request)

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.parked.pop(request.request_id, None)
        self._release(request)
        request.abort()
        self.num_aborted += 1

    def peek_prefix(self, request: Request) -> list[int]:
        """The pool's cached blocks admission would reuse for ``request``; takes nothing."""
        return self.pool.match_prefix(self._prefix_keys(request))

    def _take_prefix(self, request: Request) -> list[int]:
        """Blocks of the longest cached prefix, each with a reference taken: the pool's own hits,
        then blocks the lower tiers bring back into the pool."""
        keys = self._prefix_keys(request)
        hits = self.pool.match_prefix(keys)
        self.pool.acquire(hits)
        if self.tiers is not None:
            self.tiers.count_pool_lookup(len(hits), len(keys))
            if len(hits) < len(keys):
                hits = hits + self.tiers.load(keys[len(hits) :])
        return hits

    def _prefix_keys(self, request: Request) -> list[int]:
        # At least one token is always computed, so that there are logits to sample from.
        num_full_blocks = (request.num_tokens - 1) // self.block_size
        return request.keys_of_full_blocks(self.block_size, num_full_blocks)

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        block_ids = self.pool.allocate(needed)
        if block_ids is None:
            return False
        request.block_ids += block_ids
        return True

    def _register_full_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        keys = request.keys_of_full_blocks(self.block_size, num_full)
        for i in range(request.num_registered_blocks, num_full):
            self.pool.cache(request.block_ids[i], keys[i])
        request.num_registered_blocks = num_full

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.pool.release(reversed(request.block_ids))
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
