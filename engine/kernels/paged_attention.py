"""Paged-attention decode: one query token per sequence against its KV blocks in the pool.

The kernel reads the pool in its real byte layout (``kv_store/layout.py``), so the engine's
buffer is passed as it is, with no gather and no dequantized copy::

    pool  uint8 [num_blocks, block_bytes]
    block b:  payload [kv_heads, layers, 2 (K,V), block_size, head_dim]  | f32 scales [kv_heads, layers, 2]
              ^ b * block_bytes                                          ^ b * block_bytes + scales_offset

Grid ``(sequence, KV head, split)``. A program holds the query heads that share its KV head
(GQA) in registers as one ``[ROWS, head_dim]`` tile (padded to 16 rows for the tensor cores)
and walks its split's tokens in tiles of ``TILE`` tokens (8 KB of K: 64 FP8 tokens at head_dim
128). Each iteration looks up the tile's block ids in the table and gathers ``[TILE, head_dim]``
of K and of V from several blocks at once; pipelined, the next tile's loads are in flight while
this one is used: ~32 KB per program, where one block at a time had 4-8 KB. Scores and the
weighted sum are two ``tl.dot`` per tile with an online softmax (base 2) between them. FP8
codes are widened exactly in registers; each token's block scale multiplies its score column
(K) and its softmax weight (V), never the tile.

Split-K (flash-decoding) is there for the shape decode has on a GPU: a small batch of long
contexts gives ``batch * kv_heads`` programs, fewer than the SMs. Each split writes its partial
``(acc, max, sum)``; a second small kernel (``_combine_kernel``) merges them into the output.
With one split the decode kernel normalizes and writes the output itself, one launch in all.
``num_splits=None`` picks about four programs per SM from the batch and the table width only,
so a CUDA-graph bucket (fixed batch and width) always gets the same count; the count is a
runtime argument, so a new count does not compile the kernel again. Each row's own context is
cut into ``num_splits`` shares of whole tiles (in the kernel, from its length), so a short row
in a graph's table as wide as the longest sequence allowed still spreads over every split.

Dots run in ``q``'s dtype with float32 accumulation (K/V widened to it: exact for FP8 and
bf16 pools), float32 queries in IEEE float32 (``paged_kv.dot_types``). Reading the pool
(``load_kv_tile``, ``pool_views``, the checks) is in ``paged_kv.py``, shared with the prefill kernel.

``reference_paged_decode_attention`` is the torch reference: it decodes the same bytes with
torch's own casts and calls SDPA per sequence, sharing no code with the kernel or with
``engine/layers/attention.py``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine.kernels.launches import record
from engine.kernels.paged_kv import (
    KV_KINDS, LOG2E, MIN_DOT, check_pool, dequantized_layer, dot_types, has_native_fp8, head_dim_pad, pool_views,
)
from engine.kernels.triton_common import check_device
from kv_store.layout import KVBlockLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the serving image runs without Triton; only the kernel needs it
    triton = None

_PROGRAMS_PER_SM = 4
_TILE_BYTES = 8192
"""K bytes a decode program gathers per iteration (as many of V): 64 FP8 or 32 bf16 tokens at head_dim 128."""
_DECODE_STAGES = 5
"""Software-pipelining depth. The K/V loads wait on the block-id load before them, so Triton
3.9 gives them double buffers (the next tile in flight while this one is used) only from 5
stages; at 2-4 their single buffer is waited for right after it is issued (sm_90 TTGIR)."""
_COMBINE_SPLITS = 16

if triton is not None:
    from engine.kernels.paged_kv import attend_tile, load_kv_tile

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, kv_ptr, scale_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        stride_q_token, stride_q_head, qk_scale, block_stride, head_stride, layer_offset, v_offset,
        scale_block_stride, scale_head_stride, scale_layer_offset,
        stride_table, num_heads, num_splits,
        KV_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, HEAD_DIM_PAD)
        row_ok = rows < GROUP
        heads = kv_head * GROUP + rows
        q_offsets = seq * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
        out_offsets = (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
        row_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0).to(DOT_DTYPE)

        context_len = tl.load(context_lens_ptr + seq)
        # The splits share this row's context, not the table's width: a CUDA graph's tables are as
        # wide as the longest sequence allowed, and most of a short row's splits would idle.
        tokens_per_split = tl.cdiv(tl.cdiv(context_len, TILE), num_splits) * TILE
        first_token = split * tokens_per_split
        end_token = tl.minimum(first_token + tokens_per_split, context_len)
        table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
        kv_offset = kv_head * head_stride + layer_offset
        scale_offset = kv_head * scale_head_stride + scale_layer_offset

        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
        for tile_start in range(first_token, end_token, TILE):  # no iteration, and no KV read, for an empty row
            tokens = tile_start + tl.arange(0, TILE)
            token_ok = tokens < end_token
            k, v, k_scale, v_scale = load_kv_tile(
                kv_ptr, scale_ptr, table_row_ptr, tokens, token_ok,
                kv_offset, v_offset, block_stride, scale_block_stride, scale_offset,
                KV_KIND, NATIVE_FP8, DOT_DTYPE, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD,
            )
            running_max, running_sum, acc = attend_tile(  # a tile holds >= 1 token
                q, k, v, k_scale, v_scale, token_ok[None, :], qk_scale, running_max, running_sum, acc, DOT_DTYPE, DOT_PRECISION,
            )

        if not SPLIT:
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # an empty row: 0 / 1
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            part_rows = (seq * num_heads + heads) * num_splits + split
            tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask)
            tl.store(part_max_ptr + part_rows, running_max, mask=row_ok)
            tl.store(part_sum_ptr + part_rows, running_sum, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """One (sequence, head): merge its splits' ``(acc, max, sum)``, SPLITS at a time.

        A split that saw no token has max -inf and weight 0; a row that saw none at all
        (``context_len == 0``) gets zeros.
        """
        row = tl.program_id(0)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        running_max = tl.full([1], float("-inf"), tl.float32)
        running_sum = tl.zeros([1], tl.float32)
        acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
        for first in range(0, num_splits, SPLITS):
            splits = first + tl.arange(0, SPLITS)
            split_ok = splits < num_splits
            part_rows = row * num_splits + splits
            maxes = tl.load(part_max_ptr + part_rows, mask=split_ok, other=float("-inf"))
            sums = tl.load(part_sum_ptr + part_rows, mask=split_ok, other=0.0)
            accs = tl.load(part_acc_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
            new_max = tl.maximum(running_max, tl.max(maxes, axis=0))
            pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(running_max - pivot)
            weights = tl.exp2(maxes - pivot)
            running_sum = running_sum * rescale + tl.sum(sums * weights, axis=0)
            acc = acc * rescale + tl.sum(accs * weights[:, None], axis=0)
            running_max = new_max
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    native_fp8: bool | None = None,
    tile_tokens: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (``[batch, num_heads, head_dim]``, one token per sequence) over its context.

    ``q`` may be a strided view (the QKV projection's query heads): it is read in place where
    its last dim is contiguous. The output is a new contiguous tensor.

    ``pool`` is the engine's KV buffer (``uint8 [num_blocks, layout.block_bytes]``);
    ``block_tables[i]`` lists sequence i's blocks (padded with any valid id) and
    ``context_lens[i]`` its tokens in them, the query's own K/V included (their values are
    checked on CPU only: on CUDA a check would synchronize the device). A row with
    ``context_lens[i] == 0`` (a padding row of a CUDA-graph batch) reads no KV and no table
    entry and its output is zeros. Query head h reads KV head ``h // (num_heads // kv_heads)``.
    Returns ``[batch, num_heads, head_dim]`` in ``q``'s dtype. Runs on CUDA tensors, or on CPU
    under ``TRITON_INTERPRET=1``; on CUDA it launches one kernel (two when split), never waits
    for the device, and is capturable in a CUDA graph. ``num_splits`` (split-K, in
    ``[1, block_tables.shape[1]]``), ``native_fp8`` (hardware e4m3 conversion) and
    ``tile_tokens`` (tokens per iteration, a power of two >= 16) default to what the device
    and shapes suit; tests and bench set them to cover every path.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton (pip install the test extras, or triton on a GPU host)")
    _check_inputs(q, pool, layout, layer, block_tables, context_lens)
    check_device("paged_decode_attention", q)
    batch, num_heads, head_dim = q.shape
    group = num_heads // layout.num_kv_heads
    max_blocks = block_tables.shape[1]
    tile = _tile_tokens(q, layout, tile_tokens)
    num_tiles = -(-max_blocks * layout.block_size // tile)
    if num_splits is None:
        num_splits = _auto_num_splits(q, batch * layout.num_kv_heads, min(max_blocks, num_tiles))
    if not 1 <= num_splits <= max_blocks:
        raise ValueError(f"num_splits: must be in [1, {max_blocks}] (blocks per table), got {num_splits}")
    q = q if q.stride(2) == 1 else q.contiguous()  # a view of the QKV projection's output is read in place
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)  # unused at 1 split
    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    kv, scales, strides = pool_views(pool, layout, layer)
    dot_dtype, dot_precision = dot_types(q)
    record("paged_decode_attention")
    _paged_decode_kernel[(batch, layout.num_kv_heads, num_splits)](
        q, kv, scales, block_tables, context_lens.to(torch.int32),
        out, part_acc, part_max, part_sum, q.stride(0), q.stride(1),
        (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E, *strides,
        block_tables.stride(0), num_heads, num_splits,
        KV_KIND=KV_KINDS[layout.kv_dtype], NATIVE_FP8=has_native_fp8(q) if native_fp8 is None else native_fp8,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, GROUP=group, ROWS=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_SIZE=layout.block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim), TILE=tile,
        SPLIT=num_splits > 1, num_warps=4, num_stages=_DECODE_STAGES,
    )
    if num_splits > 1:
        record("paged_decode_combine")
        _combine_kernel[(batch * num_heads,)](
            part_acc, part_max, part_sum, out, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim), SPLITS=_COMBINE_SPLITS, num_warps=2,
        )
    return out


def _tile_tokens(q: torch.Tensor, layout: KVBlockLayout, tile_tokens: int | None) -> int:
    """``tile_tokens`` checked, or ``_TILE_BYTES`` of K, between 16 and 128 tokens.

    Float32 queries (tests) count 4 bytes whatever the pool: their IEEE dots run on the FMA
    units, and bigger tiles of them spill registers on sm_90 (on FP8 and bf16 pools they spill
    ~500 bytes even at 16 tokens; fine for tests, and the engine's queries are 16-bit).
    """
    if tile_tokens is not None:
        if tile_tokens < MIN_DOT or tile_tokens & (tile_tokens - 1):
            raise ValueError(f"tile_tokens: must be a power of two >= {MIN_DOT}, got {tile_tokens}")
        return tile_tokens
    element_bytes = 4 if q.dtype == torch.float32 else layout.element_bytes
    return max(MIN_DOT, min(128, _TILE_BYTES // (head_dim_pad(layout.head_dim) * element_bytes)))


def _auto_num_splits(q: torch.Tensor, num_programs: int, max_splits: int) -> int:
    if q.device.type != "cuda":
        return 1
    sms = _multi_processor_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    wanted = -(-_PROGRAMS_PER_SM * sms // num_programs)
    return max(1, min(wanted, max_splits))


@functools.cache
def _multi_processor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_inputs(q, pool, layout: KVBlockLayout, layer: int, block_tables, context_lens) -> None:
    if q.dim() != 3 or q.shape[2] != layout.head_dim:
        raise ValueError(f"q: expected [batch, num_heads, {layout.head_dim}], got {list(q.shape)}")
    batch, num_heads, _ = q.shape
    if num_heads % layout.num_kv_heads:
        raise ValueError(f"q: {num_heads} query heads are not a multiple of the pool's {layout.num_kv_heads} KV heads")
    check_pool(pool, layout, layer)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables: expected int32/int64 [{batch}, max_blocks >= 1], got {block_tables.dtype} {list(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens: expected [{batch}], got {list(context_lens.shape)}")
    devices = {name: t.device for name, t in (("q", q), ("pool", pool), ("block_tables", block_tables), ("context_lens", context_lens))}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, pool, block_tables and context_lens must share one device, got {devices}")
    if block_tables.device.type == "cuda":
        return  # reading the values would synchronize the device at every call
    capacity = block_tables.shape[1] * layout.block_size
    if batch and (int(context_lens.min()) < 0 or int(context_lens.max()) > capacity):
        raise ValueError(f"context_lens: every length must be in [0, {capacity}] (the tables' blocks), got {context_lens.tolist()}")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < pool.shape[0]:
        raise ValueError(f"block_tables: block ids must be in [0, {pool.shape[0]}), got [{int(block_tables.min())}, {int(block_tables.max())}]")


def reference_paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, in float32.

    Each sequence's blocks are cut out of the byte buffer, viewed with the layout's shapes,
    widened with torch's own e4m3 cast and multiplied by the trailer's scales; SDPA then runs
    with each KV head repeated for its query heads. A row of no context gives zeros.
    """
    _check_inputs(q, pool, layout, layer, block_tables, context_lens)
    group = q.shape[1] // layout.num_kv_heads
    outs = []
    for row in range(q.shape[0]):
        length = int(context_lens[row])
        if length == 0:
            outs.append(torch.zeros(q.shape[1:], dtype=torch.float32, device=q.device))
            continue
        blocks = pool[block_tables[row, : -(-length // layout.block_size)]]
        k, v = dequantized_layer(blocks, layout, layer)
        k = k[:, :length].repeat_interleave(group, dim=0)
        v = v[:, :length].repeat_interleave(group, dim=0)
        query = q[row].float().unsqueeze(1)  # [num_heads, 1, head_dim]
        outs.append(F.scaled_dot_product_attention(query, k, v, scale=sm_scale).squeeze(1))
    return torch.stack(outs).to(q.dtype)
