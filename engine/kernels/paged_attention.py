"""Paged-attention decode: one query token per sequence against its KV blocks in the pool.

The kernel reads the pool in its real byte layout (``kv_store/layout.py``), so the engine's
buffer is passed as it is, with no gather and no dequantized copy::

    pool  uint8 [num_blocks, block_bytes]
    block b:  payload [kv_heads, layers, 2 (K,V), block_size, head_dim]  | f32 scales [kv_heads, layers, 2]
              ^ b * block_bytes                                          ^ b * block_bytes + scales_offset

Grid ``(sequence, KV head, split)``. A program takes the query heads that share its KV head
(GQA) as one ``[GROUP, head_dim]`` tile, so each K/V element is read once for all of them, and
walks its split's blocks with an online softmax. FP8 codes are widened in registers and the
block's scale is folded into the scores (K) and into the weighted sum (V): one multiply per
block and head, not per element.

Split-K (flash-decoding) is there for the shape decode has on a GPU: a small batch of long
contexts gives ``batch * kv_heads`` programs, fewer than the SMs. Each split then writes its
partial ``(acc, max, sum)`` and ``_combine_splits`` merges them; with one split the kernel
normalizes and writes the output itself. ``num_splits=None`` picks enough splits to give
about four programs per SM. The count is a runtime argument, not a ``constexpr``: it follows
the context length, and as a constant each new count compiled the kernel again, every 16
decode steps.

``reference_paged_decode_attention`` is the torch reference: it decodes the same bytes with
torch's own casts and calls SDPA per sequence, sharing no code with the kernel or with
``engine/layers/attention.py``.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from kv_store.layout import KVBlockLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the serving image runs without Triton; only the kernel needs it
    triton = None

_KV_KINDS = {"fp32": 0, "bf16": 1, "fp8_e4m3": 2}
_STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
_PROGRAMS_PER_SM = 4
_FLOAT32_FROM_E4M3_MASK = tl.constexpr(0x87F00000 - (1 << 32)) if triton is not None else None
_REBIAS = tl.constexpr(2.0**120) if triton is not None else None
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton runs kernels in its interpreter when this is set before Triton is first imported (tests/conftest.py does so without CUDA)."""

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, pool_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        sm_scale, block_bytes, head_bytes, layer_k_bytes, v_offset_bytes, scales_offset, scale_head_stride,
        layer_k_scale, stride_table, num_heads, blocks_per_split, num_splits,
        KV_KIND: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr,
        NATIVE_FP8: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        slots = tl.arange(0, BLOCK_SIZE)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        heads = kv_head * GROUP + rows
        q_offsets = (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

        context_len = tl.load(context_lens_ptr + seq)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        first_block = split * blocks_per_split
        last_block = tl.minimum(first_block + blocks_per_split, num_blocks)

        # Element offsets inside one head's [block_size, head_dim] K (or V) tile, in bytes.
        if KV_KIND == 0:
            element_bytes = 4
        elif KV_KIND == 1:
            element_bytes = 2
        else:
            element_bytes = 1
        tile_offsets = (slots[:, None] * HEAD_DIM + dims[None, :]) * element_bytes

        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for index in range(first_block, last_block):
            block_id = tl.load(block_tables_ptr + seq * stride_table + index).to(tl.int64)
            block_base = pool_ptr + block_id * block_bytes
            k_base = block_base + kv_head * head_bytes + layer_k_bytes
            tile_ok = ((index * BLOCK_SIZE + slots) < context_len)[:, None] & dim_ok[None, :]
            k = _load_tile(k_base + tile_offsets, tile_ok, KV_KIND, NATIVE_FP8)
            v = _load_tile(k_base + v_offset_bytes + tile_offsets, tile_ok, KV_KIND, NATIVE_FP8)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale
            if KV_KIND == 2:
                scale_ptr = (block_base + scales_offset).to(tl.pointer_type(tl.float32))
                scale_ptr += kv_head * scale_head_stride + layer_k_scale
                scores = scores * tl.load(scale_ptr)
            slot_ok = (index * BLOCK_SIZE + slots) < context_len
            scores = tl.where(slot_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            weighted = tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
            if KV_KIND == 2:
                weighted = weighted * tl.load(scale_ptr + 1)
            acc = acc * rescale[:, None] + weighted
            running_max = new_max

        out_mask = row_ok[:, None] & dim_ok[None, :]
        if not SPLIT:
            out = acc / running_sum[:, None]
            tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part_rows = (seq * num_heads + heads) * num_splits + split
            tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
            tl.store(part_max_ptr + part_rows, running_max, mask=row_ok)
            tl.store(part_sum_ptr + part_rows, running_sum, mask=row_ok)

    @triton.jit
    def _load_tile(byte_ptrs, mask, KV_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr):
        """One [block_size, head_dim] tile as float32; FP8 stays unscaled (the caller folds the scale in).

        Without a hardware e4m3 conversion (before sm_89) the code's bits are moved into a
        float32 as kv_store/fp8.py does on CPU: exact, a shift, a mask and a multiply.
        """
        if KV_KIND == 0:
            tile = tl.load(byte_ptrs.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
        elif KV_KIND == 1:
            tile = tl.load(byte_ptrs.to(tl.pointer_type(tl.bfloat16)), mask=mask, other=0.0).to(tl.float32)
        elif NATIVE_FP8:
            codes = tl.load(byte_ptrs, mask=mask, other=0)
            tile = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            codes = tl.load(byte_ptrs.to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.int32)
            bits = (codes << 20) & _FLOAT32_FROM_E4M3_MASK
            tile = bits.to(tl.float32, bitcast=True) * _REBIAS
        return tile


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
) -> torch.Tensor:
    """Attention of ``q`` (``[batch, num_heads, head_dim]``, one token per sequence) over its context.

    ``pool`` is the engine's KV buffer (``uint8 [num_blocks, layout.block_bytes]``);
    ``block_tables[i]`` lists sequence i's blocks (padded with any valid id) and
    ``context_lens[i]`` (>= 1) its tokens in them, the query's own K/V included (their values
    are checked on CPU only: on CUDA a check would synchronize the device). Query head h
    reads KV head ``h // (num_heads // kv_heads)``. Returns ``[batch, num_heads, head_dim]``
    in ``q``'s dtype. Runs on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``.
    ``num_splits`` (split-K) and ``native_fp8`` (hardware e4m3 conversion) default to what the
    device suits; tests set them to cover every path.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton (pip install the test extras, or triton on a GPU host)")
    _check_inputs(q, pool, layout, layer, block_tables, context_lens)
    _check_device(q)
    batch, num_heads, head_dim = q.shape
    group = num_heads // layout.num_kv_heads
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = _auto_num_splits(q, batch * layout.num_kv_heads, max_blocks)
    if not 1 <= num_splits <= max_blocks:
        raise ValueError(f"num_splits: must be in [1, {max_blocks}] (blocks per table), got {num_splits}")
    blocks_per_split = -(-max_blocks // num_splits)
    q = q.contiguous()
    out = torch.empty_like(q)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)  # unused at 1 split
    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    tile_bytes = layout.block_size * layout.head_dim * layout.element_bytes
    _paged_decode_kernel[(batch, layout.num_kv_heads, num_splits)](
        q, pool, block_tables, context_lens.to(torch.int32),
        out, part_acc, part_max, part_sum,
        sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        layout.block_bytes, layout.head_bytes, layer * 2 * tile_bytes, tile_bytes,
        layout.scales_offset, layout.num_layers * 2, layer * 2,
        block_tables.stride(0), num_heads, blocks_per_split, num_splits,
        KV_KIND=_KV_KINDS[layout.kv_dtype], GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=layout.block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLIT=num_splits > 1, NATIVE_FP8=_native_fp8(q) if native_fp8 is None else native_fp8,
    )
    if num_splits == 1:
        return out
    return _combine_splits(part_acc, part_max, part_sum).to(q.dtype)


def _combine_splits(acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Merge per-split softmax partials ``[batch, heads, splits, (head_dim)]`` into the output.

    A split past a sequence's last block saw no token: its max is -inf, so its weight is 0.
    """
    overall = maxes.amax(dim=2, keepdim=True)
    weights = torch.exp(maxes - overall)
    total = (sums * weights).sum(dim=2)
    return (acc * weights[..., None]).sum(dim=2) / total[..., None]


def _auto_num_splits(q: torch.Tensor, num_programs: int, max_blocks: int) -> int:
    if q.device.type != "cuda":
        return 1
    sms = _multi_processor_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    wanted = -(-_PROGRAMS_PER_SM * sms // num_programs)
    return max(1, min(wanted, max_blocks))


@functools.cache
def _multi_processor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _native_fp8(q: torch.Tensor) -> bool:
    """Whether the device converts e4m3 in hardware (sm_89 and later; the interpreter emulates it)."""
    return q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 9)


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(
            f"paged_decode_attention runs on CUDA tensors, or on CPU when TRITON_INTERPRET=1 was set before "
            f"Triton was first imported; q is on {q.device}"
        )


def _check_inputs(q, pool, layout: KVBlockLayout, layer: int, block_tables, context_lens) -> None:
    if q.dim() != 3 or q.shape[2] != layout.head_dim:
        raise ValueError(f"q: expected [batch, num_heads, {layout.head_dim}], got {list(q.shape)}")
    batch, num_heads, _ = q.shape
    if num_heads % layout.num_kv_heads:
        raise ValueError(f"q: {num_heads} query heads are not a multiple of the pool's {layout.num_kv_heads} KV heads")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != layout.block_bytes or not pool.is_contiguous():
        raise ValueError(f"pool: expected contiguous uint8 [num_blocks, {layout.block_bytes}], got {pool.dtype} {list(pool.shape)}")
    if layout.block_size & (layout.block_size - 1):
        raise ValueError(f"layout.block_size: the kernel needs a power of two, got {layout.block_size}")
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer: {layer} outside [0, {layout.num_layers})")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables: expected int32/int64 [{batch}, max_blocks], got {block_tables.dtype} {list(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens: expected [{batch}], got {list(context_lens.shape)}")
    devices = {name: t.device for name, t in (("q", q), ("pool", pool), ("block_tables", block_tables), ("context_lens", context_lens))}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, pool, block_tables and context_lens must share one device, got {devices}")
    if block_tables.device.type == "cuda":
        return  # reading the values would synchronize the device at every call
    capacity = block_tables.shape[1] * layout.block_size
    if int(context_lens.min()) < 1 or int(context_lens.max()) > capacity:
        raise ValueError(f"context_lens: every length must be in [1, {capacity}] (the tables' blocks), got {context_lens.tolist()}")
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
    with each KV head repeated for its query heads.
    """
    _check_inputs(q, pool, layout, layer, block_tables, context_lens)
    group = q.shape[1] // layout.num_kv_heads
    outs = []
    for row in range(q.shape[0]):
        length = int(context_lens[row])
        blocks = pool[block_tables[row, : -(-length // layout.block_size)]]
        k, v = _dequantized_layer(blocks, layout, layer)
        k = k[:, :length].repeat_interleave(group, dim=0)
        v = v[:, :length].repeat_interleave(group, dim=0)
        query = q[row].float().unsqueeze(1)  # [num_heads, 1, head_dim]
        outs.append(F.scaled_dot_product_attention(query, k, v, scale=sm_scale).squeeze(1))
    return torch.stack(outs).to(q.dtype)


def _dequantized_layer(blocks: torch.Tensor, layout: KVBlockLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` from whole blocks (``uint8 [n, block_bytes]``) as float32 ``[kv_heads, n * block_size, head_dim]``."""
    n = blocks.shape[0]
    payload = blocks[:, : layout.payload_bytes].contiguous().view(_STORAGE_DTYPES[layout.kv_dtype])
    values = payload.view(n, *layout.payload_shape)[:, :, layer].float()  # [n, kv_heads, 2, block_size, head_dim]
    if layout.has_scales:
        trailer = blocks[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].contiguous()
        scales = trailer.view(torch.float32).view(n, *layout.scale_shape)[:, :, layer]  # [n, kv_heads, 2]
        values = values * scales[..., None, None]
    per_head = values.permute(1, 2, 0, 3, 4).reshape(layout.num_kv_heads, 2, n * layout.block_size, layout.head_dim)
    return per_head[:, 0], per_head[:, 1]
