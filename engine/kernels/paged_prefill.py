"""Paged-attention prefill: chunks of prompt tokens attending causally over their sequence's pool blocks.

A chunk of ``n`` query tokens of one sequence sits at positions ``[start, start + n)``; every
key it attends to, ``0 .. start + n - 1``, is already in the pool (on the GPU path each layer
writes its step's K/V before attending), so the cached prefix and the chunk's own keys are read
alike, in place. A call takes a batch of chunks whose queries lie one after another in ``q``::

    q             [total_tokens, num_heads, head_dim]
                   | chunk 0 (n0) | chunk 1 (n1) |      ...      |
    query_starts   0              n0             n0+n1    ...    total_tokens   (int32 [chunks + 1])
    starts         position of each chunk's first query in its sequence         (int32 [chunks])
    block_tables   each chunk's sequence's blocks, covering start + n tokens     ([chunks, width])

Grid ``(query tile, chunk, KV head)``, flash-attention style. A program takes ``BLOCK_Q``
consecutive query tokens times the ``GROUP`` query heads that share its KV head as one
``[BLOCK_Q * GROUP_PAD, head_dim]`` tile (row ``r`` is token ``r // GROUP_PAD``, head
``r % GROUP_PAD``), so each K/V element is read once for the whole group, and walks the keys
``0 .. (its last query's position)`` in tiles of ``BLOCK_N`` gathered from the pool with
``paged_kv.load_kv_tile``, as the decode kernel does: online softmax, FP8 scales folded into
the scores (K) and the softmax weights (V), causal mask in absolute positions (key ``j`` is
seen by the query at position ``p`` iff ``j <= p``). Query tiles past a chunk's end read
nothing and write nothing. The grid is sized by ``max_query_len``, a host integer, so a call
never waits for the device.

``reference_paged_prefill_attention`` is the torch reference: blocks decoded with torch's own
casts, one SDPA per chunk with an explicit mask, sharing no code with the kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.kernels.launches import record
from engine.kernels.paged_kv import (
    KV_KINDS, LOG2E, check_pool, dequantized_layer, dot_types, has_native_fp8, head_dim_pad, pool_views,
)
from engine.kernels.triton_common import check_device
from kv_store.layout import KVBlockLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the serving image runs without Triton; only the kernel needs it
    triton = None

if triton is not None:
    from engine.kernels.paged_kv import attend_tile, load_kv_tile

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, kv_ptr, scale_ptr, block_tables_ptr, starts_ptr, query_starts_ptr, out_ptr,
        stride_q_token, stride_q_head, qk_scale, block_stride, head_stride, layer_offset, v_offset,
        scale_block_stride, scale_head_stride, scale_layer_offset, stride_table, num_heads,
        KV_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ):
        q_tile = tl.program_id(0)
        chunk = tl.program_id(1)
        kv_head = tl.program_id(2)
        query_begin = tl.load(query_starts_ptr + chunk)
        query_len = tl.load(query_starts_ptr + chunk + 1) - query_begin
        start = tl.load(starts_ptr + chunk)

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        tokens = q_tile * BLOCK_Q + rows // GROUP_PAD
        member = rows % GROUP_PAD
        row_ok = (tokens < query_len) & (member < GROUP)
        # Rows past the chunk's end take its last position, so every row sees key 0 and stays finite.
        positions = start + tl.minimum(tokens, query_len - 1)
        heads = kv_head * GROUP + member
        q_offsets = ((query_begin + tokens) * stride_q_token + heads * stride_q_head)[:, None] + dims[None, :]
        out_offsets = ((query_begin + tokens) * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
        row_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0).to(DOT_DTYPE)

        tile_end = tl.minimum((q_tile + 1) * BLOCK_Q, query_len)
        key_end = tl.where(q_tile * BLOCK_Q < query_len, start + tile_end, 0)  # 0: a tile past the chunk reads nothing
        table_row_ptr = block_tables_ptr + chunk.to(tl.int64) * stride_table
        kv_offset = kv_head * head_stride + layer_offset
        scale_offset = kv_head * scale_head_stride + scale_layer_offset

        running_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for key_start in range(0, key_end, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_ok = keys < key_end
            k, v, k_scale, v_scale = load_kv_tile(
                kv_ptr, scale_ptr, table_row_ptr, keys, key_ok,
                kv_offset, v_offset, block_stride, scale_block_stride, scale_offset,
                KV_KIND, NATIVE_FP8, DOT_DTYPE, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD,
            )
            seen = key_ok[None, :] & (keys[None, :] <= positions[:, None])
            running_max, running_sum, acc = attend_tile(  # every row sees key 0 in the first tile
                q, k, v, k_scale, v_scale, seen, qk_scale, running_max, running_sum, acc, DOT_DTYPE, DOT_PRECISION,
            )

        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)


_TILES = {torch.float32: (32, 32)}
"""(query rows = tokens x group heads, keys) a program takes per iteration, by ``q``'s dtype:
64 x 64 for 16-bit queries (sm_90: wgmma, 228 registers, no spill). Float32 queries (tests) run
IEEE dots on the FMA units: 32 x 32 fits on a float32 pool; on FP8 or bf16 pools they spill a
few hundred bytes whatever the tile (the widened tile in the FMA dot's layout)."""
_DEFAULT_TILES = (64, 64)
_PREFILL_STAGES = 3


def paged_prefill_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    query_starts: torch.Tensor,
    max_query_len: int,
    sm_scale: float | None = None,
    native_fp8: bool | None = None,
) -> torch.Tensor:
    """Causal attention of a batch of prefill chunks over the pool (layout in the module docstring).

    ``q``: ``[total_tokens, num_heads, head_dim]``, chunk ``i``'s queries at rows
    ``query_starts[i] .. query_starts[i + 1] - 1`` (int32 ``[chunks + 1]``, from 0 to
    ``total_tokens``, non-decreasing); ``starts[i]`` (int32 ``[chunks]``) is the position of its
    first query in its sequence; ``block_tables[i]`` lists that sequence's blocks, padded with
    any valid id, and must cover ``starts[i] + (its length)`` tokens, all of them already
    written to the pool. ``max_query_len`` (a host int, >= every chunk's length) sizes the grid.
    Values are checked on CPU only (on CUDA a check would wait for the device). Query head h
    reads KV head ``h // (num_heads // kv_heads)``; ``q`` may be a view whose last dim is
    contiguous (read in place). Returns ``[total_tokens, num_heads, head_dim]`` (contiguous) in
    ``q``'s dtype, with one kernel launch; CUDA tensors, or CPU under
    ``TRITON_INTERPRET=1``. ``native_fp8``: as in ``paged_decode_attention``.
    """
    if triton is None:
        raise RuntimeError("paged_prefill_attention needs Triton (pip install the test extras, or triton on a GPU host)")
    _check_inputs(q, pool, layout, layer, block_tables, starts, query_starts, max_query_len)
    check_device("paged_prefill_attention", q)
    total_tokens, num_heads, head_dim = q.shape
    num_chunks = starts.shape[0]
    group = num_heads // layout.num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_rows, block_n = _TILES.get(q.dtype, _DEFAULT_TILES)
    block_q = max(1, block_rows // group_pad)
    q = q if q.stride(2) == 1 else q.contiguous()  # a view of the QKV projection's output is read in place
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if total_tokens == 0 or num_chunks == 0:
        return out
    kv, scales, strides = pool_views(pool, layout, layer)
    dot_dtype, dot_precision = dot_types(q)
    record("paged_prefill_attention")
    _paged_prefill_kernel[(-(-max_query_len // block_q), num_chunks, layout.num_kv_heads)](
        q, kv, scales, block_tables, starts.to(torch.int32), query_starts.to(torch.int32), out, q.stride(0), q.stride(1),
        (sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)) * LOG2E, *strides,
        block_tables.stride(0), num_heads,
        KV_KIND=KV_KINDS[layout.kv_dtype], NATIVE_FP8=has_native_fp8(q) if native_fp8 is None else native_fp8,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=layout.block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        num_warps=4, num_stages=_PREFILL_STAGES,
    )
    return out


def _check_inputs(q, pool, layout: KVBlockLayout, layer: int, block_tables, starts, query_starts, max_query_len: int) -> None:
    if q.dim() != 3 or q.shape[2] != layout.head_dim:
        raise ValueError(f"q: expected [total_tokens, num_heads, {layout.head_dim}], got {list(q.shape)}")
    if q.shape[1] % layout.num_kv_heads:
        raise ValueError(f"q: {q.shape[1]} query heads are not a multiple of the pool's {layout.num_kv_heads} KV heads")
    check_pool(pool, layout, layer)
    if starts.dim() != 1:
        raise ValueError(f"starts: expected [num_chunks], got {list(starts.shape)}")
    num_chunks = starts.shape[0]
    if query_starts.shape != (num_chunks + 1,):
        raise ValueError(f"query_starts: expected [{num_chunks + 1}] (one more than starts), got {list(query_starts.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_chunks or block_tables.shape[1] < 1 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables: expected int32/int64 [{num_chunks}, max_blocks >= 1], got {block_tables.dtype} {list(block_tables.shape)}")
    if not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len: expected an int >= 1, got {max_query_len!r}")
    tensors = (("q", q), ("pool", pool), ("block_tables", block_tables), ("starts", starts), ("query_starts", query_starts))
    devices = {name: t.device for name, t in tensors}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, pool, block_tables, starts and query_starts must share one device, got {devices}")
    if q.device.type == "cuda":
        return  # reading the values would synchronize the device at every call
    lens = query_starts[1:] - query_starts[:-1]
    if int(query_starts[0]) != 0 or int(query_starts[-1]) != q.shape[0] or bool((lens < 0).any()):
        raise ValueError(f"query_starts: must rise from 0 to {q.shape[0]} (q's tokens), got {query_starts.tolist()}")
    if num_chunks and int(lens.max()) > max_query_len:
        raise ValueError(f"max_query_len: {max_query_len} is shorter than the longest chunk ({int(lens.max())} tokens)")
    capacity = block_tables.shape[1] * layout.block_size
    ends = starts + lens
    if num_chunks and (int(starts.min()) < 0 or int(ends.max()) > capacity):
        raise ValueError(f"starts: every chunk must lie in [0, {capacity}] (the tables' blocks), got starts {starts.tolist()}, ends {ends.tolist()}")
    if not 0 <= int(block_tables.min()) <= int(block_tables.max()) < pool.shape[0]:
        raise ValueError(f"block_tables: block ids must be in [0, {pool.shape[0]}), got [{int(block_tables.min())}, {int(block_tables.max())}]")


def reference_paged_prefill_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    query_starts: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The same attention in plain torch, chunk by chunk, in float32: each chunk's blocks decoded
    with torch's casts, its KV heads repeated for their query heads, one SDPA with the causal
    mask written out in absolute positions."""
    lens = query_starts[1:] - query_starts[:-1]
    _check_inputs(q, pool, layout, layer, block_tables, starts, query_starts, max(1, int(lens.max()) if len(lens) else 1))
    group = q.shape[1] // layout.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for chunk in range(starts.shape[0]):
        first, length, start = int(query_starts[chunk]), int(lens[chunk]), int(starts[chunk])
        if length == 0:
            continue
        context = start + length
        blocks = pool[block_tables[chunk, : -(-context // layout.block_size)]]
        k, v = dequantized_layer(blocks, layout, layer)
        k = k[:, :context].repeat_interleave(group, dim=0)
        v = v[:, :context].repeat_interleave(group, dim=0)
        query = q[first : first + length].float().transpose(0, 1)  # [num_heads, length, head_dim]
        mask = torch.arange(context)[None, :] <= torch.arange(start, context)[:, None]
        attended = F.scaled_dot_product_attention(query, k, v, attn_mask=mask.to(q.device), scale=sm_scale)
        out[first : first + length] = attended.transpose(0, 1)
    return out.to(q.dtype)
