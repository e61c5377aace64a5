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

An expert-parallel replica runs attention data-parallel: each of its ranks has a KV pool of its
own (``pools[r]``) and computes its own requests. A request is given a rank when it is first
admitted (the one with the longest cached prefix, then the least loaded) and keeps it; the
token budget and the batch slots count per rank, and a request preempts only its own rank's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.request import Request, SampledTokens, TokenLogprobs
from engine.spec.speculator import Speculator
from engine.spec.verify import accepted_prefix
from kv_store.block_pool import BlockPool
from kv_store.data_parallel import DataParallelKVStore
from kv_store.tiered import TieredKVStore


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` from position ``start`` to compute this step.

    A verify chunk (speculative decoding) is the sequence's last token followed by its drafts::

        token_ids: [ ... t41 ]  drafts: (d0 d1 d2)
        chunk:          [ t41 d0 d1 d2 ]   start = 41, num_new_tokens = 4, every row sampled
    """

    request: Request
    start: int
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so a next token is sampled."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def num_sample_rows(self) -> int:
        """Rows sampled: one per draft plus one, for a chunk that samples; else none."""
        return len(self.draft_token_ids) + 1 if self.samples else 0


class Scheduler:
    """Decides which tokens of which requests run each step, and owns their blocks."""

    def __init__(
        self,
        pool: BlockPool | list[BlockPool],
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        tiers: TieredKVStore | DataParallelKVStore | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        self.pools = pool if isinstance(pool, list) else [pool]
        """One block pool per data-parallel rank (one for any replica but an expert-parallel one)."""
        self.pool = self.pools[0]
        self.tiers = tiers
        """Lower KV tiers that admission looks in after the pool (CPU, Redis): ``for_rank(r)`` is
        the store under ``pools[r]``."""
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
        self._lease_ranks: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_aborted = 0
        self.num_failed = 0
        self.num_forced_tokens = 0
        """Output tokens constraints forced (jump-forward), appended without a step each."""
        self.num_computed_prompt_tokens = 0
        """Prompt tokens whose K/V the engine computed (cache hits excluded); grows with recompute."""
        self.speculator = speculator
        """Proposes drafts for decoding sequences (speculative decoding); None decodes plainly."""
        self.in_flight: dict[Request, int] = {}
        """Tokens of each request in pipelined steps not yet landed (``LLMEngine`` with pipeline
        stages): such a request is never preempted, and its next prompt chunk runs behind them."""
        self.sampling_in_flight: set[Request] = set()
        """Requests whose step in flight samples: not scheduled again until its tokens are back."""

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

    def schedule(self, max_seqs: int | None = None) -> list[ScheduledChunk]:
        """The next step's chunks: running requests first, then admissions while blocks, the token
        budget and the batch slots last. ``max_seqs``: at most this many sequences in the step
        (a pipeline's micro-batch takes its share of the running requests)."""
        budget = [self.max_num_batched_tokens] * len(self.pools)
        cap = max_seqs if max_seqs is not None else len(self.running) + len(self.waiting)
        chunks: list[ScheduledChunk] = []
        preempted = False
        if self.speculator is not None:
            self.speculator.propose([r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens > 0])
        index = 0
        while index < len(self.running) and any(budget) and len(chunks) < cap:
            request = self.running[index]
            rank = request.dp_rank
            pending = self.in_flight.get(request, 0)  # a prompt's earlier chunks, still in the pipeline
            num_new = min(request.num_tokens - request.num_computed_tokens - pending, budget[rank])
            if num_new == 0 or request in self.sampling_in_flight:
                index += 1
                continue
            drafts = request.draft_token_ids[: budget[rank] - 1] if num_new == 1 and not pending else ()
            if drafts and not self._grow(request, 1 + len(drafts)):
                drafts = ()  # too few blocks to verify: decode plainly before preempting anyone
            num_new += len(drafts)
            while not self._grow(request, pending + num_new):
                victim = self._newest_running(rank)
                if victim is None:  # every other one is in flight: this one waits for their blocks
                    break
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                chunks.append(ScheduledChunk(request, request.num_computed_tokens + pending, num_new, drafts))
                budget[rank] -= num_new
                index += 1
                continue
            if victim is None:
                index += 1
        if preempted:
            return chunks  # while a step preempts, it admits no new request
        seqs = [0] * len(self.pools)
        for request in self.running:
            seqs[request.dp_rank] += 1
        full = [False] * len(self.pools)
        for request in list(self.waiting):
            if len(chunks) >= cap or all(full[r] or budget[r] == 0 or seqs[r] >= self.max_num_seqs for r in range(len(self.pools))):
                break
            rank = request.dp_rank if request.dp_rank is not None else self._choose_rank(request, seqs)
            if full[rank] or budget[rank] == 0 or seqs[rank] >= self.max_num_seqs:
                continue
            request.dp_rank = rank
            hits = self._take_prefix(request)
            request.block_ids = list(hits)
            request.num_registered_blocks = len(hits)
            request.num_computed_tokens = len(hits) * self.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens, budget[rank])
            if not self._grow(request, num_new):
                self._release(request)
                full[rank] = True
                continue
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            self.waiting.remove(request)
            self.running.append(request)
            seqs[rank] += 1
            if request.first_scheduled_s is None:
                request.first_scheduled_s = time.monotonic()
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget[rank] -= num_new
        return chunks

    def launched(self, chunks: list[ScheduledChunk]) -> None:
        """A pipelined step of ``chunks`` went into the pipeline (``update`` follows when it lands)."""
        for chunk in chunks:
            self.in_flight[chunk.request] = self.in_flight.get(chunk.request, 0) + chunk.num_new_tokens
            if chunk.samples:
                self.sampling_in_flight.add(chunk.request)

    def landed(self, chunks: list[ScheduledChunk]) -> None:
        """A pipelined step of ``chunks`` is back (call before ``update``)."""
        for chunk in chunks:
            left = self.in_flight.pop(chunk.request, 0) - chunk.num_new_tokens
            if left > 0:
                self.in_flight[chunk.request] = left
            if chunk.samples:
                self.sampling_in_flight.discard(chunk.request)

    def _newest_running(self, rank: int) -> Request | None:
        """The most recently admitted running request of ``rank`` not in flight (the preemption
        victim); None when every one is in flight."""
        return next((r for r in reversed(self.running) if r.dp_rank == rank and r not in self.in_flight), None)

    def _choose_rank(self, request: Request, seqs: list[int]) -> int:
        """The rank with the longest cached prefix of ``request`` (in its pool, then on in its CPU
        tier: Redis serves every rank alike), then the fewest running sequences."""
        if len(self.pools) == 1:
            return 0
        keys = self._prefix_keys(request)

        def cached(rank: int) -> int:
            hits = len(self.pools[rank].match_prefix(keys))
            cpu = self.tiers.for_rank(rank).cpu if self.tiers is not None else None
            return hits + (cpu.run_length(keys[hits:]) if cpu is not None else 0)

        return max(range(len(self.pools)), key=lambda r: (cached(r), -seqs[r], -r))

    def update(self, chunks: list[ScheduledChunk], sampled: dict[Request, SampledTokens]) -> list[Request]:
        """Advance the scheduled requests, append sampled tokens with their log-probabilities (for
        a verify chunk, the accepted drafts and one more); return the requests with new output."""
        touched = []
        for chunk in chunks:
            request = chunk.request
            step = sampled.get(request)
            tokens = step.token_ids if step is not None else ()
            if chunk.draft_token_ids and tokens:
                num_accepted = accepted_prefix(chunk.draft_token_ids, tokens)
                tokens = tokens[: num_accepted + 1]
                self.speculator.observe(request, len(chunk.draft_token_ids), num_accepted)
            num_appended = 0
            for index, token in enumerate(tokens):
                if step.logprobs is None:
                    request.append_token(token)
                else:
                    request.append_token(token, step.logprobs[index])
                num_appended += 1
                if request.finished:
                    break
            if tokens and not request.finished:
                self.num_forced_tokens += request.jump_forward()
            # A verify chunk's KV is kept for its first token and the drafts that were appended.
            request.num_computed_tokens += chunk.num_new_tokens - len(chunk.draft_token_ids) + max(0, num_appended - 1)
            if chunk.draft_token_ids:
                self._roll_back(request)
            prompt_end = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens)
            self.num_computed_prompt_tokens += max(0, prompt_end - chunk.start)
            self._register_full_blocks(request)
            if not tokens:
                continue
            touched.append(request)
            if request.finished:
                self.running.remove(request)
                if request.hold_kv:
                    self.lease(request.request_id, request.block_ids, request.dp_rank)
                self._release(request)
                if self.speculator is not None:
                    self.speculator.forget(request)
        return touched

    def _roll_back(self, request: Request) -> None:
        """Free the blocks past the sequence's computed tokens: after a verify step they hold
        only rejected drafts. (Rejected positions in the last kept block are overwritten by the
        next step; the block is not full, so it is not in the prefix cache.)"""
        num_kept = -(-request.num_computed_tokens // self.block_size)
        rejected = request.block_ids[num_kept:]
        if rejected:
            del request.block_ids[num_kept:]
            self.pools[request.dp_rank].release(reversed(rejected))

    def lease(self, request_id: str, block_ids: list[int], rank: int = 0) -> None:
        """Pin ``block_ids`` (of ``rank``'s pool) for a transfer until ``release_lease(request_id)``."""
        if request_id in self.leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        self.pools[rank].acquire(block_ids)
        self.leases[request_id] = list(block_ids)
        self._lease_ranks[request_id] = rank

    def release_lease(self, request_id: str) -> bool:
        """End a transfer's lease; False if there was none."""
        block_ids = self.leases.pop(request_id, None)
        if block_ids is None:
            return False
        self.pools[self._lease_ranks.pop(request_id)].release(reversed(block_ids))
        return True

    def park_remote(self, request: Request) -> list[int] | None:
        """Hold blocks for ``request``'s whole prompt, reusing its cached prefix; return the ids of
        the blocks the prompt's KV must be written into (those past the prefix), or None (and
        hold nothing) when too few blocks are free. Those blocks are also leased under the
        request's id: whatever becomes of the request, they stay out of the free queue until the
        transfer's owner calls ``release_lease``. The request's rank is the one admission would pick."""
        if request.dp_rank is None:
            seqs = [sum(1 for r in self.running if r.dp_rank == rank) for rank in range(len(self.pools))]
            request.dp_rank = self._choose_rank(request, seqs)
        hits = self._take_prefix(request)
        request.block_ids = list(hits)
        needed = -(-request.num_prompt_tokens // self.block_size) - len(hits)
        fresh = self.pools[request.dp_rank].allocate(needed)
        if fresh is None:
            self._release(request)
            return None
        request.block_ids += fresh
        request.num_registered_blocks = len(hits)
        request.num_cached_tokens = len(hits) * self.block_size
        self.parked[request.request_id] = request
        self.lease(request.request_id, fresh, request.dp_rank)
        return fresh

    def join_remote(self, request: Request, first_token: int, logprobs: TokenLogprobs | None = None) -> None:
        """The prompt's KV has landed: mark it computed, cache its full blocks, append the token
        the prefill worker sampled (with its log-probabilities, where asked) and start decoding
        (or finish, if that token ends it)."""
        del self.parked[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        self.num_computed_prompt_tokens += request.num_prompt_tokens - request.num_cached_tokens
        self._register_full_blocks(request)
        if logprobs is None:
            request.append_token(first_token)
        else:
            request.append_token(first_token, logprobs)
        if not request.finished:
            self.num_forced_tokens += request.jump_forward()
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
        self._drop(request)
        request.abort()
        self.num_aborted += 1

    def fail(self, request: Request) -> None:
        """Drop a request whose step raised for it alone (``engine/isolation.py``), wherever it
        is (a failed update may have left it half-finished), and free its blocks. Its own state
        is left as it is: its detokenizer may be what raised."""
        self._drop(request)
        self.num_failed += 1

    def _drop(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.parked.pop(request.request_id, None)
        self._release(request)
        if self.speculator is not None:
            self.speculator.forget(request)

    def peek_prefix(self, request: Request) -> list[int]:
        """The cached blocks admission would reuse for ``request`` (on the rank it would pick); takes nothing."""
        keys = self._prefix_keys(request)
        return max((pool.match_prefix(keys) for pool in self.pools), key=len)

    def _take_prefix(self, request: Request) -> list[int]:
        """Blocks of the longest cached prefix, each with a reference taken: the pool's own hits,
        then blocks the lower tiers bring back into the pool. None for a request that still owes
        prompt log-probabilities: a hit would skip the positions they are read from (as in vLLM)."""
        if request.owes_prompt_logprobs:
            return []
        keys = self._prefix_keys(request)
        pool = self.pools[request.dp_rank]
        hits = pool.match_prefix(keys)
        pool.acquire(hits)
        if self.tiers is not None:
            tiers = self.tiers.for_rank(request.dp_rank)
            tiers.count_pool_lookup(len(hits), len(keys))
            if len(hits) < len(keys):
                hits = hits + tiers.load(keys[len(hits) :])
        return hits

    def _prefix_keys(self, request: Request) -> list[int]:
        # At least one token is always computed, so that there are logits to sample from.
        num_full_blocks = (request.num_tokens - 1) // self.block_size
        return request.keys_of_full_blocks(self.block_size, num_full_blocks)

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        block_ids = self.pools[request.dp_rank].allocate(needed)
        if block_ids is None:
            return False
        request.block_ids += block_ids
        return True

    def _register_full_blocks(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        keys = request.keys_of_full_blocks(self.block_size, num_full)
        pool = self.pools[request.dp_rank]
        for i in range(request.num_registered_blocks, num_full):
            pool.cache(request.block_ids[i], keys[i])
        request.num_registered_blocks = num_full

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        if request.dp_rank is not None:
            self.pools[request.dp_rank].release(reversed(request.block_ids))
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
