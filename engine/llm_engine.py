"""LLMEngine: requests in, tokens and text out, one scheduler step at a time.

This is the object both worker roles wrap. It is synchronous and single-threaded: callers add
and abort requests between ``step()`` calls.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from engine.build import build_kv_store, build_shard, build_speculator, key_namespace, model_len, split_group
from engine.bundled import resolve_model, served_model_name
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, RequestFailedError
from engine.intake import PromptIntake
from engine.isolation import IsolatedStep, blames_a_request, inputs_of, run_isolating
from engine.model_config import ModelConfig
from engine.outputs import Completion, EngineStats, PrefilledKV, RemotePrefill
from engine.parallel.group import TPGroup
from engine.parallel.pipeline import PipelineGroup, check_pp_size
from engine.parallel.sharding import check_ep_size, check_tp_size
from engine.params import SamplingParams
from engine.request import Request, RequestOutput, SampledTokens, TokenLogprobs
from engine.runner import ModelRunner
from engine.scheduler import ScheduledChunk, Scheduler
from engine.step_plan import Launched
from engine.structured.backend import GrammarBackend
from engine.structured.step_masks import StepMasks
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from kv_store.block_pool import BlockPool
from kv_store.events import KVEventBatch, KVEventLog, KVSnapshot

logger = logging.getLogger(__name__)


class LLMEngine:
    """Loads one model, owns its KV pool, and runs continuous batching over submitted requests."""

    def __init__(self, config: EngineConfig, worker_id: str = "local", group: TPGroup | PipelineGroup | None = None) -> None:
        """``group``: the joined group of this engine's ranks, which it leads (rank 0), required
        when ``config.num_ranks > 1`` (tensor- or expert-parallel; a ``PipelineGroup`` when the
        replica has pipeline stages); its other ranks run ``engine.parallel.follower.TPFollower``."""
        group = group or TPGroup.single()
        if group.size != config.num_ranks or not group.is_leader:
            raise ValueError(f"group: an engine of {config.num_ranks} ranks needs rank 0 of a group of that size, got rank {group.rank} of {group.size}")
        self.config = config
        self.worker_id = worker_id
        self.group = group
        tp, ep = split_group(config, group)
        self.checkpoint_dir: Path = resolve_model(config.model, config.cache_dir)
        self.model_name = served_model_name(config.model)
        self.model_config = ModelConfig.from_dir(self.checkpoint_dir)
        check_tp_size(self.model_name, self.model_config, config.tp_size)
        check_ep_size(self.model_name, self.model_config, config.ep_size)
        check_pp_size(self.model_name, self.model_config, config.pp_size)
        self.pipe = group if isinstance(group, PipelineGroup) else None
        """This engine's pipeline (stage 0 of it), when the replica is split in stages."""
        self.tokenizer = Tokenizer.from_dir(self.checkpoint_dir)
        mc = self.model_config
        self.max_model_len = model_len(config, mc)
        model, self.kv_cache = build_shard(config, mc, self.checkpoint_dir, self.max_model_len, tp, ep, self.pipe.stage if self.pipe else None)
        num_blocks = self.kv_cache.num_blocks
        self.pools = [BlockPool(num_blocks, enable_caching=config.enable_prefix_caching) for _ in range(ep.size)]
        """One block pool per data-parallel rank; ``pools[r]``'s blocks are in rank r's KV cache."""
        self.pool = self.pools[0]
        self.namespace = key_namespace(config, self.model_name, self.checkpoint_dir, tp.size)
        self.kv_events = KVEventLog(worker_id)
        self.kv_store = build_kv_store(config, self.pools, self.kv_cache, model.shard.kv_heads, mc.num_kv_heads, self.namespace, self.kv_events, tp, ep)
        """The KV tiers under the pools; on a replica of several ranks, each rank moves its own
        slice (tensor-parallel) or its own blocks (expert-parallel) as the leader decides."""
        self.speculator = (
            build_speculator(config, self.model_name, mc, self.max_model_len, num_blocks) if config.speculative != "off" else None
        )
        self.scheduler = Scheduler(
            self.pools, config.block_size, config.max_num_seqs, config.max_num_batched_tokens, self.kv_store, self.speculator
        )
        self.runner = ModelRunner(model, self.kv_cache, tp, ep, self.pipe)
        if self.kv_cache.device.type == "cuda" and not config.enforce_eager and group.size == 1:
            self.runner.use_graphs(config.graph_max_batch or config.max_num_seqs, self.max_model_len, capture=True)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self.intake = PromptIntake(self.tokenizer, self.model_name, mc.vocab_size, self.max_model_len, config.block_size, num_blocks)
        self._requests: dict[str, Request] = {}
        self._num_steps = self._num_step_tokens = 0
        self._step_s = self._step_cpu_s = 0.0
        self._prefilled: dict[str, Request] = {}
        self._seeds = random.Random(config.seed)
        self._failures: list[RequestFailedError] = []
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = threading.Lock()
        self._step_masks: StepMasks | None = None
        self._launched: deque[tuple[list[ScheduledChunk], Launched]] = deque()
        """Pipelined steps launched and not landed, oldest first."""
        self._last_failed_inputs: frozenset[tuple[int, ...]] | None = None
        """The inputs of the last step that ran, when every request of it failed."""
        group.barrier()  # every follower has its shard loaded: the first step's collectives will not wait on a load

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        tenant_salt: str | None = None,
        hold_kv: bool = False,
        arrival_s: float | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request: a text prompt, token ids, or chat ``messages`` (exactly one).

        Raises InvalidRequestError naming the field when the request cannot be served; nothing
        is allocated before every check has passed. With ``hold_kv`` the prompt's blocks are
        leased when the request finishes, for ``take_prefilled`` and ``release_lease``.
        ``arrival_s`` (``time.monotonic``) backdates the request's arrival to when it reached the
        worker; its queue time counts from there. ``resume_token_ids`` continues a request another
        replica started: the output it already streamed, which is computed with the prompt and
        not streamed again (``Request.resume``); a seeded request then samples what it would have.
        """
        request = self._new_request(request_id, prompt, params, messages, tenant_salt, arrival_s, resume_token_ids)
        request.hold_kv = hold_kv
        self._requests[request_id] = request
        self.scheduler.add(request)

    def add_remote_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        tenant_salt: str | None = None,
        max_local_prefill_tokens: int = 0,
        arrival_s: float | None = None,
    ) -> RemotePrefill | None:
        """Admit a request whose prompt KV another worker computes: park it with blocks for the
        prompt and return where the KV must land, then ``join_remote`` or ``unpark_remote``.

        Returns None, and queues the request for a local prefill instead, when at most
        ``max_local_prefill_tokens`` of the prompt are not cached here, too few blocks are free, or
        it asks for prompt log-probabilities (only the worker computing the prompt has its logits).
        Raises InvalidRequestError as ``add_request`` does; ``arrival_s`` as there.
        """
        request = self._new_request(request_id, prompt, params, messages, tenant_salt, arrival_s)
        self._requests[request_id] = request
        fresh = None
        uncached = request.num_prompt_tokens - len(self.scheduler.peek_prefix(request)) * self.config.block_size
        if uncached > max_local_prefill_tokens and request.params.prompt_logprobs is None:
            fresh = self.scheduler.park_remote(request)
        if fresh is None:
            self.scheduler.add(request)
            return None
        self.kv_store.synchronize()  # a GPU pool: copies of evicted blocks to the CPU tier finish before a peer writes the blocks
        return RemotePrefill(
            request_id=request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            first_block=len(request.block_ids) - len(fresh),
            block_ids=tuple(fresh),
            num_cached_tokens=request.num_cached_tokens,
            dp_rank=request.dp_rank,
        )

    def join_remote(self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """The parked request's prompt KV is in its blocks: start decoding after ``first_token``
        (its ``logprobs`` as the prefill worker read them, where the request asks).

        Returns the output carrying that token, or None if the request is no longer parked
        (aborted meanwhile). The transfer's lease is the caller's to release.
        """
        request = self.scheduler.parked.get(request_id)
        if request is None:
            return None
        vocab = self.model_config.vocab_size
        if not 0 <= first_token < vocab:
            raise InvalidRequestError("first_token", f"token id {first_token} is outside the vocabulary [0, {vocab})")
        self.scheduler.join_remote(request, first_token, logprobs if request.params.logprobs is not None else None)
        if request.finished:
            del self._requests[request_id]
        return request.take_output()

    def unpark_remote(self, request_id: str, recompute: bool) -> bool:
        """The remote prefill failed: prefill locally (``recompute``) or drop the request.

        False if the request is no longer parked. The transfer's lease is the caller's to release.
        """
        request = self.scheduler.parked.get(request_id)
        if request is None:
            return False
        if not recompute:
            return self.abort_request(request_id)
        self.scheduler.requeue_remote(request)
        return True

    def take_prefilled(self, request_id: str) -> PrefilledKV:
        """The result of a finished ``hold_kv`` request; its blocks stay leased."""
        request = self._prefilled.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} is not a finished hold_kv request")
        return PrefilledKV(
            request_id=request_id,
            first_token=request.output_token_ids[0],
            block_ids=tuple(self.scheduler.leases[request_id]),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def release_lease(self, request_id: str) -> bool:
        """A transfer into or out of ``request_id``'s blocks is over: let them go."""
        self._prefilled.pop(request_id, None)
        return self.scheduler.release_lease(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request)
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that produced tokens.

        A request whose part of the step raises fails alone (``engine/isolation.py``): its
        blocks are freed and ``take_failures`` reports it; the others go on with the tokens
        they would have had without it. A failure no request can be blamed for propagates.
        """
        started_s, started_cpu_s = time.perf_counter(), time.thread_time()
        if self.pipe is not None:
            chunks, sampled = self._pipeline_step()
            failed = {}
        else:
            chunks = self.scheduler.schedule()
            step = self._execute(chunks)
            failed, sampled = dict(step.failed), step.sampled
            chunks = [chunk for chunk in chunks if chunk.request not in failed]
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        for chunk in chunks:
            if chunk.request.first_token_s is None:  # a step on its way to the first token
                chunk.request.prefill_steps += 1
                chunk.request.prefill_step_tokens += num_tokens
        outputs = []
        for request in self._update(chunks, sampled, failed):
            outputs.append(request.take_output())
            if request.finished:
                del self._requests[request.request_id]
                if request.hold_kv:
                    self._prefilled[request.request_id] = request
        for request, error in failed.items():
            self._fail(request, error)
        self.kv_events.flush()
        if chunks:
            self._num_steps += 1
            self._num_step_tokens += num_tokens
            self._step_cpu_s += time.thread_time() - started_cpu_s  # read inside the wall clock's interval
            self._step_s += time.perf_counter() - started_s
        return outputs

    def _pipeline_step(self) -> tuple[list[ScheduledChunk], dict[Request, SampledTokens]]:
        """Launch the next micro-batch into the pipeline (its share of the unfinished requests,
        none of them in flight); land the oldest once ``pp_size`` are in flight, or when there is
        nothing new to launch. Returns the landed step's chunks, less those of requests aborted
        meanwhile, and their tokens; ``([], {})`` while the pipeline fills."""
        scheduler = self.scheduler
        chunks = scheduler.schedule(max_seqs=max(1, -(-scheduler.num_unfinished // self.config.pp_size)))
        if chunks:
            self._launched.append((chunks, self.runner.launch(chunks)))
            scheduler.launched(chunks)
        if not self._launched or (chunks and len(self._launched) < self.config.pp_size):
            return [], {}
        chunks, launched = self._launched.popleft()
        masks = self._step_masks.start(chunks) if self._grammars is not None else None
        sampled = self.runner.land(launched, masks)
        scheduler.landed(chunks)
        return [chunk for chunk in chunks if self._requests.get(chunk.request.request_id) is chunk.request], sampled

    def take_failures(self) -> list[RequestFailedError]:
        """The requests failed alone by the steps since the last call (each already dropped,
        its blocks freed); the caller ends their streams with these errors."""
        failures, self._failures = self._failures, []
        return failures

    def _execute(self, chunks: list[ScheduledChunk]) -> IsolatedStep:
        """Run the step's chunks, setting apart the requests that make it raise. Requests of
        two or more different inputs all failing, in this step alone or in it and the step
        before (which also failed all it ran), blame the engine, not the requests: this step's
        first error propagates. Requests of one input raise alike (a client sending the same
        poison several times, or retrying it): they are one request's evidence, and fail alone."""
        if not chunks:
            return IsolatedStep({}, {})
        masks = self._step_masks.start(chunks) if self._grammars is not None else None
        self.kv_store.flush_moves()  # the followers save what this step's blocks held before the step overwrites them
        if self.group.size > 1:  # the other ranks may be stuck in a collective of the failed run
            return IsolatedStep(self.runner.execute(chunks, masks), {})
        step = run_isolating(lambda part: self.runner.execute(part, masks), chunks)
        failed_inputs = inputs_of(chunks) if len(step.failed) == len(chunks) else None
        if failed_inputs and len(failed_inputs | (self._last_failed_inputs or frozenset())) > 1:
            raise next(iter(step.failed.values()))
        self._last_failed_inputs = failed_inputs
        return step

    def _update(self, chunks: list[ScheduledChunk], sampled: dict[Request, SampledTokens], failed: dict[Request, Exception]) -> list[Request]:
        """``Scheduler.update`` one chunk at a time: a request whose update raises (its stop
        check or detokenizer, on its own tokens) joins ``failed``; the others' updates stand."""
        touched = []
        for chunk in chunks:
            try:
                touched += self.scheduler.update([chunk], sampled)
            except Exception as error:
                if not blames_a_request(error):
                    raise
                failed[chunk.request] = error
        return [request for request in touched if request not in failed]

    def _fail(self, request: Request, error: Exception) -> None:
        """Drop a request that failed alone, free its blocks and report it (``take_failures``)."""
        logger.error("request %s failed alone and is dropped; the engine goes on", request.request_id, exc_info=error)
        self._requests.pop(request.request_id, None)
        self.scheduler.fail(request)
        self._failures.append(RequestFailedError(request.request_id, f"{type(error).__name__}: {error}"))

    def kv_snapshot(self) -> KVSnapshot:
        """This engine's block keys per tier, with the number of the last KV event batch they include."""
        return self.kv_store.snapshot()

    def kv_events_since(self, seq: int) -> list[KVEventBatch]:
        """Sealed KV event batches after ``seq`` (thread-safe); EventGap if some are gone."""
        self.kv_events.flush()
        return self.kv_events.since(seq)

    def offload_prefix_cache(self) -> int:
        """Push every cached block no request holds down to the CPU / Redis tiers (as evictions
        do); returns how many left the pool."""
        return self.kv_store.evict_pool()

    @property
    def grammars(self) -> GrammarBackend:
        """Compiles constraints for this model's tokenizer (built at the first constrained
        request: llguidance's tokenizer takes ~0.3 s). Thread-safe: a worker compiles a
        request's constraint from another thread before ``add_request`` (which then finds it
        cached), so a slow compile never holds up a step."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    config = self.config
                    self._step_masks = StepMasks(self.model_config.vocab_size)
                    self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, config.grammar_compile_timeout_s, config.grammar_cache_size)
        return self._grammars

    def close(self) -> None:
        """Stop background work (the Redis tier's writer) and the follower ranks' step loops."""
        self.kv_store.close()
        if self._step_masks is not None:
            self._step_masks.close()
        if self.group.size > 1:
            while self._launched:  # the last stage's logits of steps in flight: taken, so that its sends end
                self._launched.popleft()
                self.pipe.recv_logits()
            self.runner.stop_followers()
            self.group.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block key, e.g. between benchmark runs over the same prompts."""
        for pool in self.pools:
            pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=sum(p.num_blocks for p in self.pools),
            num_free_kv_blocks=sum(p.num_free_blocks for p in self.pools),
            num_cached_kv_blocks=sum(p.num_cached_blocks for p in self.pools),
            num_preemptions=self.scheduler.num_preemptions,
            num_aborted_requests=self.scheduler.num_aborted,
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            num_parked=len(self.scheduler.parked),
            num_leases=len(self.scheduler.leases),
            num_queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens,
            num_steps=self._num_steps,
            num_step_tokens=self._num_step_tokens,
            step_s=self._step_s,
            step_cpu_s=self._step_cpu_s,
            num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            num_accepted_draft_tokens=self.speculator.num_accepted_tokens if self.speculator else 0,
            num_forced_tokens=self.scheduler.num_forced_tokens,
            num_grammar_compiles=self._grammars.stats().num_compiles if self._grammars else 0,
            grammar_compile_s=self._grammars.stats().compile_s_total if self._grammars else 0.0,
            num_failed_requests=self.scheduler.num_failed,
        )

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run prompts to completion together; results in prompt order."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(request_id, prompt, p)
        return self.run_to_completion(ids)

    def run_to_completion(self, request_ids: Sequence[str]) -> list[Completion]:
        """Step until every listed request has finished; results in the listed order. Raises
        RequestFailedError when one of them fails alone (the others are left where they are)."""
        requests = {rid: self._requests[rid] for rid in request_ids}
        texts = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        while pending:
            outputs = self.step()
            failure = next((f for f in self.take_failures() if f.request_id in pending), None)
            if failure is not None:
                raise failure
            for out in outputs:
                if out.request_id in texts:
                    texts[out.request_id].append(out.text_delta)
                    if out.finished:
                        pending.discard(out.request_id)
        return [
            Completion(
                request_id=rid,
                prompt_token_ids=tuple(r.prompt_token_ids),
                output_token_ids=tuple(r.output_token_ids),
                text="".join(texts[rid]),
                finish_reason=r.finish_reason,
                num_cached_tokens=r.num_cached_tokens,
            )
            for rid, r in requests.items()
        ]

    def _new_request(self, request_id, prompt, params, messages, tenant_salt, arrival_s: float | None = None, resume_token_ids: Sequence[int] = ()) -> Request:
        params = params or SamplingParams()
        if request_id in self._requests or request_id in self.scheduler.leases:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        prompt_token_ids = self.intake.prompt_token_ids(prompt, messages)
        resume_token_ids = self.intake.token_ids_in_vocab("resume_token_ids", resume_token_ids)
        self.intake.check_fits(prompt_token_ids, params)
        self.intake.token_ids_in_vocab("logit_bias", [token_id for token_id, _ in params.logit_bias])
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        grammar = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            root_key=self.namespace.root_key(tenant_salt),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            seed=seed,
            grammar=grammar,
        )
        try:
            request.resume(resume_token_ids)
        except ValueError as e:
            raise InvalidRequestError("resume_token_ids", str(e)) from None
        if arrival_s is not None:
            request.arrival_s = arrival_s
        return request
