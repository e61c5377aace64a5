"""Causal self-attention over the paged KV cache.

One forward step mixes sequences in decode (one new token each) with chunks of prompts being
prefilled. All tokens of the step go through the projections together; attention then runs per
decode group (sequences of similar context length, padded within the group) and per prefill
chunk.

The cache holds the K/V of tokens computed in earlier steps. This step's own K/V are patched
into the gathered context at their positions and stashed in ``AttentionBatch.new_k/new_v``; the
model runner writes them to the cache once, for every layer together, after the forward pass.
For FP8 that turns thirty requantizations of the touched blocks into one.

On the device path (``PagedKVCache.triton_decode``: a GPU, or the tests' interpreter) the step
carries a ``DeviceStep`` instead: one Triton kernel rotates q and k in the QKV projection's output
and writes the step's K/V straight into the pool (FP8 quantized there,
``engine/kernels/rope_kv.py``), and the decode rows attend over the pool in place through the
paged kernel (``engine/kernels/paged_attention.py``), which reads FP8 blocks with their scales.
Its shapes are fixed by the step's buffers and nothing waits for the host, so a decode step of
this path can be captured in a CUDA graph (``engine/graphs.py``).

Where the C extension is built (``engine/kernels/cpu_attention.py``), decode groups and short
prefill chunks read the pool in place instead, with the step's K/V passed beside it: the same
contract, without the gathered copy. The torch code stays as the fallback and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.kernels import cpu_attention
from engine.kernels.kv_segments import KVSegments
from engine.kv_cache import PagedKVCache
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.parallel.sharding import TPShard


NATIVE_MAX_CHUNK_TOKENS = 8
"""Prefill chunks this short (speculative verify chunks: 1 + 4 drafts by default) run in the C
kernel too; longer ones gather and call SDPA, whose matrix products win from about 16 tokens
(measured on SmolLM2's shapes, 1 and 2 threads)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended together; tables padded to the group's longest context."""

    tokens: slice
    """Where the group's tokens sit in the step's flat token batch (always a contiguous run)."""
    rows: torch.Tensor
    """[batch] 0 .. batch-1, for indexing the gathered context row by row."""
    positions: torch.Tensor
    """[batch] each token's position in its sequence (= its slot in the gathered context)."""
    block_tables: torch.Tensor
    """[batch, num_blocks] block ids, padded with any valid id."""
    mask: torch.Tensor
    """[batch, 1, 1, num_blocks * block_size] True where the key is inside the context."""

    @cached_property
    def sequences(self) -> cpu_attention.PagedSequences:
        """The group as the C kernel takes it; built by the first layer, reused by the others."""
        return cpu_attention.PagedSequences.decode(self.block_tables, self.positions)

    @cached_property
    def context_lens(self) -> torch.Tensor:
        """``int32 [batch]`` tokens each sequence attends over, its own included (the Triton kernel's)."""
        return (self.positions + 1).to(torch.int32)


@dataclass(frozen=True)
class PrefillChunk:
    """A run of consecutive prompt tokens of one sequence."""

    token_start: int
    """First position of the chunk in the step's flat token batch."""
    num_tokens: int
    start: int
    """Position in the sequence of the chunk's first token."""
    block_table: torch.Tensor
    """[1, num_blocks] every block of the sequence up to the chunk's end."""
    mask: torch.Tensor
    """[num_tokens, num_blocks * block_size] causal mask in absolute positions."""

    @cached_property
    def sequences(self) -> cpu_attention.PagedSequences:
        """The chunk as the C kernel takes it; built by the first layer, reused by the others."""
        return cpu_attention.PagedSequences.chunk(self.block_table, self.start, self.num_tokens)


@dataclass(frozen=True)
class DeviceStep:
    """A step on the device path: where its K/V go, and what its decode rows attend over.

    The flat batch's first ``num_decodes`` rows are decode tokens (one per sequence); prefill
    chunks, if any, follow (``AttentionBatch.prefill_chunks``). A replayed CUDA graph's step is
    a view of static buffers: padding rows write nothing (their KV run's block id is -1).
    """

    positions: torch.Tensor
    """``[tokens]`` each token's position in its sequence (RoPE)."""
    segments: KVSegments
    """The step's K/V slots as runs of tokens per block (``engine/kernels/rope_kv.py``)."""
    num_decodes: int
    block_tables: torch.Tensor
    """``int32 [num_decodes, width]`` the decode rows' blocks, padded with any valid id."""
    context_lens: torch.Tensor
    """``int32 [num_decodes]`` tokens each decode row attends over, its own included."""
    num_splits: int | None = None
    """Split-K of the decode kernel; None lets it choose (a graph fixes it at capture)."""
    prefills: DevicePrefills | None = None
    """The step's prefill chunks (rows after the decodes), attended in one paged prefill call."""


@dataclass(frozen=True)
class DevicePrefills:
    """Every prefill chunk of a device-path step, as ``paged_prefill_attention`` takes them."""

    block_tables: torch.Tensor
    """``int32 [chunks, width]`` each chunk's sequence's blocks up to the chunk's end, padded."""
    starts: torch.Tensor
    """``int32 [chunks]`` position of each chunk's first token in its sequence."""
    query_starts: torch.Tensor
    """``int32 [chunks + 1]`` where each chunk's rows begin among the prefill rows; the last is their count."""
    max_query_len: int


@dataclass(frozen=True)
class AttentionBatch:
    """Everything attention needs for one step, built once per step by the model runner."""

    kv_cache: PagedKVCache
    rope_cos: torch.Tensor
    """[num_tokens, 1, head_dim] rotary tables at each token's position; on the device path the
    whole float32 table ``[max_positions, head_dim]``, which the RoPE kernel indexes itself."""
    rope_sin: torch.Tensor
    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]
    new_k: torch.Tensor | None
    """[num_tokens, num_layers, kv_heads, head_dim] filled by each layer, written to the cache
    after the step; None on the device path, where each layer writes its own."""
    new_v: torch.Tensor | None
    device: DeviceStep | None = None
    """The device path's step (``rope_cos``/``rope_sin`` are then the whole float32 tables)."""


class PagedAttention(torch.nn.Module):
    """QKV projection, optional per-head q/k norm (Qwen3), RoPE, paged attention, output projection.

    Under tensor parallelism the module holds its rank's heads (``shard.heads``) and KV heads
    (``shard.kv_heads``): QKV is column-split by head, o_proj row-split with one all-reduce.
    """

    def __init__(self, config: ModelConfig, layer_index: int, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = len(shard.heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = hd = config.head_dim
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        q_rows = range(shard.heads.start * hd, shard.heads.stop * hd)
        kv_rows = range(shard.kv_heads.start * hd, shard.kv_heads.stop * hd)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [("q", q_rows), ("k", kv_rows), ("v", kv_rows)], bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(q_rows, config.hidden_size, tp, bias=config.o_bias)
        self.o_proj.output_promoted = True  # added to the residual
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if batch.device is not None:
            return self._forward_device(hidden, batch, batch.device)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k are adjacent in the projection: rotate them together as one run of heads.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = apply_rotary(qk, batch.rope_cos, batch.rope_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        batch.new_k[:, self.layer_index] = k
        batch.new_v[:, self.layer_index] = v
        if len(batch.decode_groups) == 1 and not batch.prefill_chunks:  # every token in one group: no scatter
            out = self._decode(q, k, v, batch.decode_groups[0], batch.kv_cache)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for group in batch.decode_groups:
            out[group.tokens] = self._decode(q[group.tokens], k[group.tokens], v[group.tokens], group, batch.kv_cache)
        for chunk in batch.prefill_chunks:
            span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[span] = self._prefill(q[span], k[span], v[span], chunk, batch.kv_cache)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _forward_device(self, hidden: torch.Tensor, batch: AttentionBatch, step: DeviceStep) -> torch.Tensor:
        """The device path: RoPE and the K/V write in one kernel, then attention over the pool in place."""
        from engine.kernels.paged_attention import paged_decode_attention  # Triton: only where this path runs
        from engine.kernels.rope_kv import rope_write_kv

        num_tokens, kv_cache = hidden.shape[0], batch.kv_cache
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk.copy_(torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1))
        rope_write_kv(qkv, step.positions, batch.rope_cos, batch.rope_sin, kv_cache.buffer, kv_cache.layout, self.layer_index, step.segments, self.num_heads)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        decodes = slice(0, step.num_decodes)
        if step.prefills is None:
            out = paged_decode_attention(q, kv_cache.buffer, kv_cache.layout, self.layer_index, step.block_tables, step.context_lens, num_splits=step.num_splits)
            return self.o_proj(out.view(num_tokens, self.q_size))
        from engine.kernels.paged_prefill import paged_prefill_attention

        prefills = step.prefills
        out = paged_prefill_attention(
            q[step.num_decodes :], kv_cache.buffer, kv_cache.layout, self.layer_index,
            prefills.block_tables, prefills.starts, prefills.query_starts, prefills.max_query_len,
        )
        if step.num_decodes:
            decoded = paged_decode_attention(q[decodes], kv_cache.buffer, kv_cache.layout, self.layer_index, step.block_tables, step.context_lens)
            out = torch.cat((decoded, out))
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _decode(self, q, k, v, group: DecodeGroup, kv_cache: PagedKVCache) -> torch.Tensor:
        if _native(kv_cache, q):
            return cpu_attention.paged_attention(q, k, v, kv_cache.native, self.layer_index, group.sequences)
        keys, values = kv_cache.gather(self.layer_index, group.block_tables)
        keys[group.rows, :, group.positions] = k
        values[group.rows, :, group.positions] = v
        # One query per sequence: fold the query heads of each KV head into the "query length"
        # axis, so GQA needs neither repeated K/V nor enable_gqa.
        grouped = q.reshape(q.shape[0], self.num_kv_heads, -1, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.mask)
        return out.reshape(q.shape)

    def _prefill(self, q, k, v, chunk: PrefillChunk, kv_cache: PagedKVCache) -> torch.Tensor:
        if chunk.num_tokens <= NATIVE_MAX_CHUNK_TOKENS and _native(kv_cache, q):
            return cpu_attention.paged_attention(q, k, v, kv_cache.native, self.layer_index, chunk.sequences)
        if chunk.start == 0:  # the chunk is its own whole context: causal over its fresh K/V, no gather
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True
            )
            return out.squeeze(0).transpose(0, 1)
        keys, values = kv_cache.gather(self.layer_index, chunk.block_table)
        span = slice(chunk.start, chunk.start + chunk.num_tokens)
        keys[0, :, span] = k.transpose(0, 1)
        values[0, :, span] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=chunk.mask, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)


def _native(kv_cache: PagedKVCache, q: torch.Tensor) -> bool:
    """Whether the C kernel attends: built, switched on, a CPU pool, a dtype it takes."""
    return cpu_attention.NATIVE_ATTENTION and kv_cache.native is not None and q.dtype in cpu_attention.NATIVE_DTYPES
