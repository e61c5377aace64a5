"""Build one step's flat token batch from scheduled chunks, run the model, sample.

Decode tokens come first in the flat batch, then prefill chunks. Decode sequences are sorted by
context length and cut into groups whose padded width stays close to their real width, so a
single long sequence does not make every short one attend over padding.

Under tensor parallelism the leader (rank 0) turns the scheduler's chunks into a ``StepPlan``
(plain ids and positions, no request objects), sends it to the other ranks, and every rank runs
the same step on its shard; logits reach the leader only, which samples. Under expert
parallelism attention is data-parallel: the leader sends one plan per rank (each rank's own
requests, an empty plan for an idle rank, which still steps so that the experts' all-to-alls
never wait on it), and each rank's sampled rows are gathered on the leader. A follower rank runs
``ModelRunner.follow()``: receive the plans, run its own, until the leader sends ``None``.

Under pipeline parallelism (engine/parallel/pipeline.py) a step is launched and landed apart:
``launch`` runs stage 0 and hands the plan and hidden stream on, ``land`` takes the last stage's
logits and samples, so that the leader can launch the next micro-batch meanwhile. Stages after
the first run ``follow_pipeline()``: their plan comes with their input, from the stage before.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

import torch

from engine.device_sampler import SamplingTensors, sample_on_device
from engine.kernels.kv_segments import KVSegments
from engine.kv_cache import PagedKVCache
from engine.layers.attention import AttentionBatch, DecodeGroup, DevicePrefills, DeviceStep, PrefillChunk
from engine.logits import SampleRow, process_logits, record_prompt_logprobs, sample_rows, sampled_logprobs, stack_bitmasks
from engine.models.decoder import DecoderModel
from engine.parallel.group import TPGroup
from engine.parallel.pipeline import PipelineGroup
from engine.request import Request, SampledTokens
from engine.sampler import sample
from engine.scheduler import ScheduledChunk
from engine.step_plan import Launched, PlannedChunk, StepPlan
from engine.structured.step_masks import masks_of

_GROUP_GROWTH = 1.25
"""A decode group closes when the next sequence would need this many times its first one's blocks."""


class ModelRunner:
    """Owns the model and the KV tensors; turns scheduled chunks into sampled tokens."""

    def __init__(
        self, model: DecoderModel, kv_cache: PagedKVCache, tp: TPGroup | None = None, dp: TPGroup | None = None, pipe: PipelineGroup | None = None
    ) -> None:
        """``pipe``: this rank's place in a pipelined replica (None: the model is not split in stages)."""
        self.model = model
        self.pipe = pipe
        self.kv_cache = kv_cache
        self.tp = tp or TPGroup.single()
        self.dp = dp or TPGroup.single()
        """The data-parallel ranks of an expert-parallel replica (each with requests of its own)."""
        self.ranks = self.tp if self.tp.size > 1 else self.dp
        """The group that steps together, whose leader sends the plans."""
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.device
        self.dtype = model.held_layers[0].input_layernorm.weight.dtype
        self.num_runs = 0
        """Steps this rank has run to the end, K/V written: every rank of a group counts the same steps."""
        self.busy_s = 0.0
        """Seconds this rank spent running steps (its stage's share of a pipeline's time)."""
        self.graphs = None
        """``engine.graphs.DecodeGraphs`` where decode steps run from static buffers (``use_graphs``)."""
        self.num_graph_steps = 0
        """Steps run through ``graphs`` (replayed, or eagerly on their buffers where none was captured)."""

    def use_graphs(self, max_batch: int, max_model_len: int, capture: bool) -> None:
        """Run decode steps of up to ``max_batch`` sequences from static buffers, and on CUDA
        (``capture``) replay them as CUDA graphs captured now. The device path of one rank only."""
        if not self.kv_cache.triton_decode or self.ranks.size > 1:
            raise ValueError("use_graphs: decode graphs run on the device path of a replica of one rank")
        from engine.graphs import DecodeGraphs  # imports the Triton kernels: only where the device path runs

        self.graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, -(-max_model_len // self.block_size))
        if capture:
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], bitmasks: Mapping[Request, torch.Tensor] | Future | None = None) -> dict[Request, SampledTokens]:
        """Leader: run one step of ``chunks`` on every rank; the tokens sampled for each request
        that samples (one, or one per row of a verify chunk: row j is its output token n + j),
        with their log-probabilities where asked. Prompt log-probabilities of the step's prompt
        positions are recorded on their requests (``Request.add_prompt_logprobs``).

        ``bitmasks``: a constraint's allowed tokens per constrained request, ``int32 [1 + drafts,
        ceil(vocab / 32)]`` (row j after drafts 0..j-1; bit j of word w allows token 32 w + j), or
        a future of them being filled while the forward pass runs (``StepMasks.start``).
        Steps whose rows process logits or want log-probabilities run eagerly, never from a graph.
        A pipelined replica's step runs through every stage before this returns (``launch`` and
        ``land`` keep several in flight)."""
        if self.pipe is not None:
            return self.land(self.launch(chunks), bitmasks)
        plans, requests, spans = [], [], []
        for rank in range(self.dp.size):
            plan, sampled, prompt = StepPlan.of([c for c in chunks if (c.request.dp_rank or 0) == rank], self.block_size)
            plans.append(plan)
            requests += sampled
            spans += prompt
        rows = sample_rows(requests)
        plan = plans[0]
        plain = bitmasks is None and not any(r.processes_logits or r.params.logprobs is not None or r.params.constraint is not None for r in rows)
        if self.graphs is not None and self.graphs.covers(len(plan.decodes), len(plan.prefills), len(plan.sample_rows), plain):
            decodes = [(c.token_ids[0], c.start, c.block_ids) for c in plan.decodes]
            tokens = self.graphs.run(decodes, [r.params for r in rows], [r.seed for r in rows], [r.position for r in rows]).tolist()
            self.num_runs += 1
            self.num_graph_steps += 1
            return _by_request(requests, tokens, [None] * len(rows))
        self.ranks.send_plan(plans)
        logits, prompt_logits = self._run_own(plans)
        record_prompt_logprobs(prompt_logits, spans)
        return self._sample_requests(requests, rows, logits, bitmasks) if requests else {}

    def _sample_requests(
        self, requests: list[tuple[Request, tuple[int, ...]]], rows: list[SampleRow], logits: torch.Tensor, bitmasks: Mapping[Request, torch.Tensor] | Future | None
    ) -> dict[Request, SampledTokens]:
        """Each request's tokens from its ``rows`` (``sample_rows(requests)``) of ``logits`` (processed
        first: bias, penalties, its constraint's ``bitmasks``), with their log-probabilities where asked."""
        bitmask, bitmask_rows = stack_bitmasks(requests, masks_of(bitmasks), logits.device)
        logits = process_logits(logits, rows, bitmask, bitmask_rows)
        tokens = self._sample(logits, [r.params for r in rows], [r.seed for r in rows], [r.position for r in rows])
        return _by_request(requests, tokens, sampled_logprobs(logits, rows, tokens))

    def _sample(self, logits: torch.Tensor, params: list, seeds: list[int], positions: list[int]) -> list[int]:
        """The device path samples with the graphs' sampler in every step, so that a request's
        tokens do not depend on which of its steps were replayed; the CPU path with ``sample``.
        ``logits`` are processed already (``engine/logits.py``)."""
        if self.kv_cache.triton_decode:
            return sample_on_device(logits, SamplingTensors.of(params, seeds, positions, logits.device)).tolist()
        return sample(logits, params, seeds, positions)

    def launch(self, chunks: list[ScheduledChunk]) -> Launched:
        """Leader of a pipelined replica: run stage 0 of ``chunks`` and hand the plan and hidden
        stream to stage 1; ``land`` the returned step, in launch order, for its tokens."""
        plan, requests, spans = StepPlan.of(chunks, self.block_size)
        self.tp.send_plan([plan])
        self.pipe.send_forward(plan, self.run(plan))
        return Launched(plan, requests, spans)

    @torch.inference_mode()
    def land(self, step: Launched, bitmasks: Mapping[Request, torch.Tensor] | Future | None = None) -> dict[Request, SampledTokens]:
        """Leader: the last stage's logits of the oldest step launched, sampled (as ``execute``)."""
        logits = self.pipe.recv_logits()
        num_prompt = len(step.plan.prompt_rows)
        record_prompt_logprobs(logits[:num_prompt] if num_prompt else None, step.spans)
        return self._sample_requests(step.requests, sample_rows(step.requests), logits[num_prompt:], bitmasks) if step.requests else {}

    def follow_pipeline(self) -> int:
        """A rank of a stage after the first: run each plan on the hidden stream that comes with
        it, hand the result to the next stage (the last stage's TP leader: the logits, to the
        replica's leader), until the stop comes; returns the number of steps run."""
        pipe = self.pipe
        while True:
            plan, hidden = pipe.recv_forward(self.dtype)
            if plan is None:
                if not pipe.stage.is_last:
                    pipe.send_forward(None, None)
                return self.num_runs
            out = self.run(plan, hidden)
            if not pipe.stage.is_last:
                pipe.send_forward(plan, out)
            elif self.tp.is_leader:
                pipe.send_logits(out)

    def follow(self, on_message: Callable[[object], None] | None = None) -> int:
        """Follower: run the leader's plans until it sends None; returns the number of steps run.
        Anything else the leader sends between plans (its KV tiers' block moves) goes to
        ``on_message``, in order."""
        while (plans := self.ranks.receive_plan()) is not None:
            if isinstance(plans, list) and self.pipe is not None:  # a TP rank of stage 0: hand its stream on
                self.pipe.send_forward(plans[0], self.run(plans[0]))
            elif isinstance(plans, list):
                self._run_own(plans)
            elif on_message is not None:
                on_message(plans)
            else:
                raise ValueError(f"a follower rank without KV tiers got {type(plans).__name__} from its leader")
        if self.pipe is not None:
            self.pipe.send_forward(None, None)
        return self.num_runs

    def stop_followers(self) -> None:
        """Leader: tell the other ranks that no step follows."""
        self.ranks.send_plan(None)
        if self.pipe is not None:
            self.pipe.send_forward(None, None)

    def _run_own(self, plans: list[StepPlan]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run this rank's plan; on the leader, every rank's logits of its sample rows, and of its
        prompt rows, each in rank order."""
        logits = self.run(plans[self.dp.rank])
        if self.dp.size > 1:
            counts = [len(p.logit_rows) for p in plans]
            padded = logits.new_zeros((max(counts), logits.shape[1]))
            padded[: len(logits)] = logits
            gathered = self.dp.gather_to_leader(padded, dim=0)
            if gathered is None:
                return None, None
            width = max(counts)
            logits = torch.cat([gathered[r * width : r * width + n] for r, n in enumerate(counts)])
        if logits is None or not any(p.prompt_rows for p in plans):
            return logits, None
        own, start = ([], []), 0
        for p in plans:
            own[0].append(logits[start + len(p.prompt_rows) : start + len(p.logit_rows)])
            own[1].append(logits[start : start + len(p.prompt_rows)])
            start += len(p.logit_rows)
        return torch.cat(own[0]), torch.cat(own[1])

    @torch.inference_mode()
    def run(self, plan: StepPlan, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run ``plan`` on this rank's shard and write its K/V; logits of the prompt rows then the
        sample rows (``plan.logit_rows``) on the leader. In a pipeline, a stage after the first
        takes ``inputs`` (the stage before's hidden stream; the first embeds the plan's tokens), a
        stage before the last returns its own stream, and the last stage's TP leader the logits
        it sends the replica's leader (none is a message too)."""
        started = time.perf_counter()
        slots = None
        if self.kv_cache.triton_decode:
            input_ids, batch = self._device_batch(plan)
        else:
            input_ids, batch, slots = self._batch(plan)
        hidden = self.model(input_ids if inputs is None else inputs, batch)
        if slots is not None and len(input_ids):  # an idle data-parallel rank runs the step for its collectives, with nothing to store
            self.kv_cache.write(batch.new_k, batch.new_v, *slots)
        if not self.model.stage.is_last:
            out = hidden
        elif plan.logit_rows or self.dp.size > 1:  # a data-parallel rank always computes (maybe zero rows of) logits: the leader gathers every rank's
            out = self.model.compute_logits(hidden[list(plan.logit_rows)])
        elif self.pipe is not None and self.tp.is_leader:
            out = hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        else:
            out = None
        self.num_runs += 1
        self.busy_s += time.perf_counter() - started
        return out

    def _batch(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionBatch, tuple[torch.Tensor, torch.Tensor]]:
        """The CPU path's step, and its slots (block ids, offsets): the runner writes every layer's
        K/V there after the forward pass."""
        input_ids, positions, slot_block_ids = self._flat(plan)
        device = self.device
        position_t = torch.tensor(positions, dtype=torch.long, device=device)
        cos, sin = self.model.rotary.tables(position_t, self.dtype)
        new_kv_shape = (len(positions), len(self.model.held_layers), self.model.num_kv_heads, self.model.config.head_dim)
        batch = AttentionBatch(
            kv_cache=self.kv_cache,
            rope_cos=cos,
            rope_sin=sin,
            decode_groups=self._decode_groups(plan.decodes),
            prefill_chunks=self._prefill_chunks(plan.prefills, first_token=len(plan.decodes)),
            new_k=torch.empty(new_kv_shape, dtype=self.dtype, device=device),
            new_v=torch.empty(new_kv_shape, dtype=self.dtype, device=device),
        )
        slots = (torch.tensor(slot_block_ids, dtype=torch.long, device=device), position_t % self.block_size)
        return torch.tensor(input_ids, dtype=torch.long, device=device), batch, slots

    def _device_batch(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionBatch]:
        """The device path's eager step: each layer writes its K/V into the pool before attending."""
        input_ids, positions, slot_block_ids = self._flat(plan)
        device = self.device
        decodes = plan.decodes
        step = DeviceStep(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            segments=KVSegments.of_slots(slot_block_ids, [p % self.block_size for p in positions], device),
            num_decodes=len(decodes),
            block_tables=_padded_tables(decodes, device),
            context_lens=torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32, device=device),
            prefills=_device_prefills(plan.prefills, device) if plan.prefills else None,
        )
        rotary = self.model.rotary
        batch = AttentionBatch(self.kv_cache, rotary.cos, rotary.sin, decode_groups=(), prefill_chunks=(), new_k=None, new_v=None, device=step)
        return torch.tensor(input_ids, dtype=torch.long, device=device), batch

    def _flat(self, plan: StepPlan) -> tuple[list[int], list[int], list[int]]:
        """The step's token ids, their positions and the block each stores its K/V in, decodes first."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block_ids: list[int] = []
        for chunk in plan.decodes + plan.prefills:
            input_ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + chunk.num_tokens)
            slot_block_ids += (chunk.block_ids[p // self.block_size] for p in range(chunk.start, chunk.start + chunk.num_tokens))
        return input_ids, positions, slot_block_ids

    def _decode_groups(self, decodes: tuple[PlannedChunk, ...]) -> tuple[DecodeGroup, ...]:
        groups: list[list[tuple[int, PlannedChunk]]] = []
        for index, chunk in enumerate(decodes):
            num_blocks = chunk.start // self.block_size + 1
            if not groups or num_blocks > _GROUP_GROWTH * (groups[-1][0][1].start // self.block_size + 1):
                groups.append([])
            groups[-1].append((index, chunk))
        return tuple(self._decode_group(g) for g in groups)

    def _decode_group(self, members: list[tuple[int, PlannedChunk]]) -> DecodeGroup:
        width = members[-1][1].start // self.block_size + 1
        # One tensor from nested lists: a tensor per row and a copy each cost ~10 us apiece per step.
        device = self.device
        tables = torch.tensor([c.block_ids + (c.block_ids[0],) * (width - len(c.block_ids)) for _, c in members], dtype=torch.long, device=device)
        positions = torch.tensor([chunk.start for _, chunk in members], dtype=torch.long, device=device)
        key_positions = torch.arange(width * self.block_size, device=device)
        mask = (key_positions[None, :] <= positions[:, None])[:, None, None, :]
        tokens = slice(members[0][0], members[-1][0] + 1)
        rows = torch.arange(len(members), device=device)
        return DecodeGroup(tokens=tokens, rows=rows, positions=positions, block_tables=tables, mask=mask)

    def _prefill_chunks(self, prefills: tuple[PlannedChunk, ...], first_token: int) -> tuple[PrefillChunk, ...]:
        out = []
        token_start = first_token
        for chunk in prefills:
            end = chunk.start + chunk.num_tokens
            table = torch.tensor([chunk.block_ids], dtype=torch.long, device=self.device)
            query_positions = torch.arange(chunk.start, end, device=self.device)
            key_positions = torch.arange(len(chunk.block_ids) * self.block_size, device=self.device)
            mask = key_positions[None, :] <= query_positions[:, None]
            out.append(PrefillChunk(token_start, chunk.num_tokens, chunk.start, table, mask))
            token_start += chunk.num_tokens
        return tuple(out)


def _by_request(requests: list[tuple[Request, tuple[int, ...]]], tokens: list[int], logprobs: list) -> dict[Request, SampledTokens]:
    """The step's sampled rows, in order, as each request's tokens (one, or one per row of a
    verify chunk), with their log-probabilities where the request asked for them."""
    out, row = {}, 0
    for request, drafts in requests:
        end = row + len(drafts) + 1
        out[request] = SampledTokens(tokens[row:end], tuple(logprobs[row:end]) if request.params.logprobs is not None else None)
        row = end
    return out


def _padded_tables(chunks: tuple[PlannedChunk, ...], device: torch.device) -> torch.Tensor:
    """``int32 [chunks, widest]`` the chunks' block ids, each row padded with its first block."""
    width = max((len(c.block_ids) for c in chunks), default=1)
    rows = [c.block_ids + (c.block_ids[0],) * (width - len(c.block_ids)) for c in chunks]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(chunks), width)


def _device_prefills(prefills: tuple[PlannedChunk, ...], device: torch.device) -> DevicePrefills:
    lengths = [c.num_tokens for c in prefills]
    return DevicePrefills(
        block_tables=_padded_tables(prefills, device),
        starts=torch.tensor([c.start for c in prefills], dtype=torch.int32, device=device),
        query_starts=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
        max_query_len=max(lengths),
    )
