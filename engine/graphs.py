"""Decode steps replayed as CUDA graphs, one per batch-size bucket, over static buffers.

A decode step on the device path launches a fixed sequence of kernels whose shapes depend only
on the batch size: every input lives in a buffer this class owns, sized for the largest bucket,
and each bucket's step reads the first ``bucket`` rows of them. At start-up each bucket's step
is run once (Triton compiles, cuBLAS picks its kernels) and then captured; a step of ``n``
sequences copies its inputs into the buffers, pads rows ``n .. bucket-1`` and replays the graph
of the smallest bucket that holds it. The model does not know whether it is being captured.

::

    row        0 .. n-1                 n .. bucket-1 (padding)        bucket .. max-1
    input_ids  the sequences' tokens    0                              (not read)
    slots      their (block, offset)    block -1: the KV write skips   (not read)
    tables     their block tables       context length 0: reads no KV  (not read)
    sampling   their parameters         greedy                         (not read)
    tokens     sampled here ─────────── discarded

Where no graph was captured (a CPU pool, as the tests run it) the same step runs eagerly on the
same buffers: the static inputs, the padding and the device sampler are exercised everywhere.
Prefill, mixed and speculative verify steps, steps with a row that processes its logits or asks
for log-probabilities, and a decode batch above the largest bucket, run eagerly through
``ModelRunner.run`` (the last is logged once).
"""

from __future__ import annotations

import logging

import torch

from engine.device_sampler import SamplingTensors, sample_on_device
from engine.kernels.kv_segments import KVSegments
from engine.kv_cache import PagedKVCache
from engine.layers.attention import AttentionBatch, DeviceStep
from engine.models.decoder import DecoderModel
from engine.params import SamplingParams

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch``, and ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return tuple(sizes) + (max_batch,)


class GraphCaptureError(ValueError):
    """Capturing a bucket's graph failed at start-up (out of device memory, most often)."""


class DecodeGraphs:
    """The static buffers of decode steps up to ``max_batch`` sequences and, on CUDA, their graphs."""

    def __init__(self, model: DecoderModel, kv_cache: PagedKVCache, max_batch: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = graph_buckets(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        rows, device = self.buckets[-1], kv_cache.device
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, **int32)
        self.context_lens = torch.ones(rows, **int32)
        self.slot_block_ids = torch.full((rows,), -1, **int32)
        self.slot_offsets = torch.zeros(rows, **int32)
        self._token_starts = torch.arange(rows, **int32)
        self._ones = torch.ones(rows, **int32)
        self.sampling = SamplingTensors.empty(rows, device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._warned_too_large = False

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def covers(self, num_decodes: int, num_prefills: int, num_sample_rows: int, plain: bool = True) -> bool:
        """Whether a step of these chunks runs here: decodes only, each sampled, within the largest
        bucket, and ``plain``: no row processes its logits (penalties, logit bias, min_tokens, a
        constraint's bitmask) or asks for log-probabilities. The captured step samples the model's
        raw logits and returns tokens only, so such steps run eagerly (``engine/logits.py``)."""
        if not plain or num_prefills or not num_decodes or num_sample_rows != num_decodes:
            return False
        if num_decodes > self.max_batch:
            if not self._warned_too_large:
                logger.warning("a decode batch of %d exceeds the largest graph bucket (%d): such steps run eagerly", num_decodes, self.max_batch)
                self._warned_too_large = True
            return False
        return True

    def bucket(self, num_decodes: int) -> int:
        return next(b for b in self.buckets if b >= num_decodes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Run and capture every bucket's step, largest first, sharing one memory pool (CUDA only)."""
        if self.kv_cache.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA pool, this one is on {self.kv_cache.device}")
        self._pad(0, self.max_batch)
        pool = None
        for bucket in reversed(self.buckets):
            try:
                self._step(bucket)  # warm-up: compiles the Triton kernels and settles cuBLAS outside the capture
                torch.cuda.synchronize(self.kv_cache.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(bucket)
            except torch.cuda.OutOfMemoryError as e:
                free, total = torch.cuda.mem_get_info(self.kv_cache.device)
                raise GraphCaptureError(
                    f"graph_max_batch: capturing the decode step of {bucket} sequences ran out of memory on {self.kv_cache.device} "
                    f"({free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB); lower graph_max_batch or kv_cache_bytes, "
                    f"or set enforce_eager ({e})"
                ) from e
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.kv_cache.device)

    @torch.inference_mode()
    def run(self, decodes: list[tuple[int, int, tuple[int, ...]]], params: list[SamplingParams], seeds: list[int], positions: list[int]) -> torch.Tensor:
        """Sampled tokens (``int64 [n]``, on the device) of one decode step; ``decodes[i]`` is
        (token id, position, block ids up to the position's block) of row i."""
        n = len(decodes)
        bucket = self.bucket(n)
        self._fill(decodes)
        self._pad(n, bucket)
        self.sampling.fill(params, seeds, positions)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)
        return self.tokens[:n]

    def _fill(self, decodes: list[tuple[int, int, tuple[int, ...]]]) -> None:
        n, block_size, width = len(decodes), self.kv_cache.layout.block_size, self.max_blocks_per_seq
        rows = torch.tensor([(token, pos, pos + 1, blocks[pos // block_size], pos % block_size) for token, pos, blocks in decodes], dtype=torch.int64)
        for row, (_, _, blocks) in enumerate(decodes):
            if len(blocks) > width:
                raise ValueError(f"block_ids: row {row} has {len(blocks)} blocks, the graphs' tables hold {width}")
        tables = torch.tensor([blocks + (0,) * (width - len(blocks)) for _, _, blocks in decodes], dtype=torch.int32)
        self.input_ids[:n].copy_(rows[:, 0], non_blocking=True)
        self.positions[:n].copy_(rows[:, 1], non_blocking=True)
        self.context_lens[:n].copy_(rows[:, 2], non_blocking=True)
        self.slot_block_ids[:n].copy_(rows[:, 3], non_blocking=True)
        self.slot_offsets[:n].copy_(rows[:, 4], non_blocking=True)
        self.block_tables[:n].copy_(tables, non_blocking=True)

    def _pad(self, start: int, stop: int) -> None:
        if start >= stop:
            return
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.context_lens[start:stop] = 0
        self.slot_block_ids[start:stop] = -1
        self.block_tables[start:stop] = 0

    def batch(self, bucket: int) -> AttentionBatch:
        """The attention inputs of a step of ``bucket`` rows: views of the static buffers."""
        step = DeviceStep(
            positions=self.positions[:bucket],
            segments=KVSegments(self.slot_block_ids[:bucket], self._token_starts[:bucket], self.slot_offsets[:bucket], self._ones[:bucket], 1),
            num_decodes=bucket,
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
        )
        rotary = self.model.rotary
        return AttentionBatch(self.kv_cache, rotary.cos, rotary.sin, decode_groups=(), prefill_chunks=(), new_k=None, new_v=None, device=step)

    def _step(self, bucket: int) -> None:
        """The captured body: the model over the first ``bucket`` rows, then sampling, into ``tokens``."""
        hidden = self.model(self.input_ids[:bucket], self.batch(bucket))
        logits = self.model.compute_logits(hidden)
        self.tokens[:bucket].copy_(sample_on_device(logits, self.sampling.head(bucket)))
