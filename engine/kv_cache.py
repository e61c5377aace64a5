"""The KV pool as tensors: one byte buffer of ``num_blocks`` blocks laid out as kv_store.layout.

Attention writes new K/V into slots ``(block_id, offset)`` and reads a sequence's context back by
gathering its block table. FP8 blocks are requantized on write: a block's scale is the amax of
the tokens it holds so far, so the last, partly filled block may be re-rounded as it grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels import cpu_attention
from kv_store.fp8 import FP8_DTYPE, dequantize_fp8, fp8_scales, quantize_fp8
from kv_store.layout import KVBlockLayout

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}


@dataclass(frozen=True)
class BlockFill:
    """The blocks a write touches, each once, and how full each is after it: what requantizing
    FP8 blocks needs, computed once per step where every layer writes on its own."""

    unique_ids: torch.Tensor
    """``[n]`` the distinct block ids written."""
    inverse: torch.Tensor
    """``[tokens]`` each slot's index into ``unique_ids``."""
    valid: torch.Tensor
    """``bool [n, block_size]`` the slots holding a token once the write is done."""

    @classmethod
    def of(cls, block_ids: torch.Tensor, offsets: torch.Tensor, block_size: int) -> BlockFill:
        unique_ids, inverse = torch.unique(block_ids, return_inverse=True)
        fill = torch.zeros(len(unique_ids), dtype=torch.long, device=block_ids.device).scatter_reduce_(0, inverse, offsets + 1, "amax")
        return cls(unique_ids, inverse, torch.arange(block_size, device=block_ids.device) < fill[:, None])


class PagedKVCache:
    """All KV blocks of one model shard in one contiguous ``uint8`` buffer ``[num_blocks, block_bytes]``."""

    def __init__(self, layout: KVBlockLayout, num_blocks: int, compute_dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self.native: cpu_attention.NativePool | None = None
        """The same bytes as the C kernels read them (engine/kernels/cpu_attention.py); None off the CPU."""
        if self.device.type == "cpu":
            # numpy's zeros come from calloc: pages are zeroed lazily by the kernel as they are first
            # touched, so a large pool costs nothing until it is used. Zero, not garbage: attention
            # reads (masked) slots that were never written, and NaN * 0 would still be NaN.
            array = np.zeros((num_blocks, layout.block_bytes), dtype=np.uint8)
            self.buffer = torch.from_numpy(array)
            self.native = cpu_attention.NativePool.of(array, layout)
        else:
            self.buffer = torch.zeros((num_blocks, layout.block_bytes), dtype=torch.uint8, device=self.device)
        self.triton_decode = self.device.type == "cuda"
        """The GPU path: each layer writes its step's K/V into the pool before attending
        (``write(..., layers=...)``) and decode attention reads the pool through the Triton kernel
        (``engine/kernels/paged_attention.py``). On a CPU pool only under ``TRITON_INTERPRET=1``,
        which the tests set to run this path here."""
        storage = STORAGE_DTYPES[layout.kv_dtype]
        payload = self.buffer[:, : layout.payload_bytes].view(storage)
        self.payload = payload.view(num_blocks, *layout.payload_shape)
        self.scales: torch.Tensor | None = None
        if layout.has_scales:
            trailer = self.buffer[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes]
            self.scales = trailer.view(torch.float32).view(num_blocks, *layout.scale_shape)
            self.scales.fill_(1.0)

    def write(
        self, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor,
        layers: slice = slice(None), fill: BlockFill | None = None,
    ) -> None:
        """Store ``k``, ``v`` (``[num_tokens, num_layers, kv_heads, head_dim]``) at slots ``(block_ids[i], offsets[i])``.

        Every layer at once, or the run ``layers`` of them (k and v then hold those layers only).
        Slots of one block must continue the block from its current fill level (how sequences
        grow), so that the block's valid prefix is known. FP8 pools are written by the C kernel
        where it is built, bit for bit what the torch code below does. ``fill``: FP8 blocks'
        ``BlockFill`` of these slots, given when one step writes layer by layer (on a GPU its
        ``torch.unique`` waits for the device, and its other ops are launches per layer).
        """
        whole = layers == slice(None)
        native = cpu_attention.NATIVE_ATTENTION and self.native is not None
        if self.scales is not None and native and whole and k.dtype in cpu_attention.NATIVE_DTYPES:
            cpu_attention.write_fp8(k, v, block_ids, offsets, self.native)
            return
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [tokens, kv_heads, layers, head_dim]
        if self.scales is None:
            self.payload[block_ids, :, layers, 0, offsets] = k.to(self.payload.dtype)
            self.payload[block_ids, :, layers, 1, offsets] = v.to(self.payload.dtype)
            return
        if fill is None:
            fill = BlockFill.of(block_ids, offsets, self.layout.block_size)
        unique_ids, inverse = fill.unique_ids, fill.inverse
        blocks = dequantize_fp8(self.payload[unique_ids, :, layers], self.scales[unique_ids, :, layers])
        blocks[inverse, :, :, 0, offsets] = k.float()
        blocks[inverse, :, :, 1, offsets] = v.float()
        blocks *= fill.valid[:, None, None, None, :, None]
        scales = fp8_scales(blocks, num_group_dims=4)
        self.payload[unique_ids, :, layers] = quantize_fp8(blocks, scales)
        self.scales[unique_ids, :, layers] = scales

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_tables`` (``[batch, num_blocks]``) as ``[batch, kv_heads, num_blocks * block_size, head_dim]``.

        One copy for both: indexing the view ``[kv_heads, 2, blocks, block_size, head_dim]``
        along its block axis lands the blocks in ``[kv_heads, 2, batch, num_blocks, block_size,
        head_dim]`` order, which K and V view as the result without another copy.
        (``index_select`` would first make the whole strided view contiguous: the entire pool.)
        """
        batch, width = block_tables.shape
        picked = self.payload[:, :, layer].permute(1, 2, 0, 3, 4)[:, :, block_tables]
        if self.scales is not None:
            scales = self.scales[:, :, layer].permute(1, 2, 0)[:, :, block_tables]
            picked = dequantize_fp8(picked, scales, self.compute_dtype)
        elif picked.dtype != self.compute_dtype:
            picked = picked.to(self.compute_dtype)
        kv = picked.view(self.layout.num_kv_heads, 2, batch, width * self.layout.block_size, self.layout.head_dim)
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
