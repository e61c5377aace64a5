"""KV block codec: float K/V to the bytes of a kv_store.layout block and back, as pure functions.

``quantize_blocks`` gives, byte for byte, what engine.kv_cache.PagedKVCache stores for a full block
written in one go (same kv_store.fp8 math, same layout), so a prefill worker can quantize a block
and write it into a decode worker's pool, where attention reads it unchanged. Scales are per
(block, head, layer, K/V), so quantizing a range of heads alone gives the same bytes as that
range of the whole block: a tensor-parallel rank encodes its own heads.
"""

from __future__ import annotations

import torch

from kv_store.fp8 import FP8_DTYPE, FP8_E4M3_MAX, dequantize_fp8, fp8_scales
from kv_store.layout import KVBlockLayout

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}
"""Element dtype of a block's payload, by layout.kv_dtype."""

_SERIAL_NUMEL = 32768
"""torch runs an op over fewer elements than this (at::internal::GRAIN_SIZE) on the calling thread.

The codec works in chunks below it, so it never starts an OpenMP team: where the other cores are
busy (the engine), a team stalls at every op until its descheduled threads run, which made
chunked encoding about 40x slower on 2 cores. Small chunks also keep the temporaries in cache.
"""


def quantize_blocks(kv: torch.Tensor, layout: KVBlockLayout, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Encode ``kv`` ``[n, kv_heads, layers, 2, block_size, head_dim]`` (float) as ``n`` blocks.

    Returns ``uint8 [n, layout.block_bytes]``: the payload in ``layout.kv_dtype`` (fp8 with its
    float32 scales in the trailer; bf16 and fp32 a plain cast) and zero padding. ``out``, a
    contiguous ``uint8 [n, block_bytes]`` tensor on kv's device (for instance a slice of a
    registered pool), receives the blocks instead of a new tensor and is returned.
    """
    _check_kv(kv, layout)
    num_blocks = kv.shape[0]
    if out is None:
        out = torch.empty((num_blocks, layout.block_bytes), dtype=torch.uint8, device=kv.device)
    else:
        _check_blocks(out, layout, "out")
        if out.shape[0] != num_blocks or out.device != kv.device:
            raise ValueError(
                f"out: must hold kv's {num_blocks} blocks on {kv.device}, got {out.shape[0]} on {out.device}"
            )
    payload, scales = _views(out, layout)
    temp = torch.empty((_rows_per_chunk(layout), layout.block_size * layout.head_dim), device=kv.device)
    for block in range(num_blocks):
        block_src, block_dst = _groups(kv[block]), _groups(payload[block])
        for rows in _row_chunks(layout):
            src, dst = block_src[rows], block_dst[rows]
            if scales is None:
                dst.copy_(src)
                continue
            group_scales = fp8_scales(src, num_group_dims=1)
            # kv_store.fp8.quantize_fp8's math (divide, saturate, cast), into temp and dst, not new tensors
            scaled = torch.div(src, group_scales[:, None], out=temp[: len(src)])
            dst.copy_(scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX))
            scales[block].view(-1)[rows] = group_scales
    for pad in _padding(layout):
        out[:, pad.start : pad.stop].zero_()
    return out


def dequantize_blocks(buf: torch.Tensor, layout: KVBlockLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``buf`` ``uint8 [n, layout.block_bytes]`` to ``[n, kv_heads, layers, 2, block_size, head_dim]`` in ``dtype``."""
    _check_blocks(buf, layout, "buf")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating dtype, got {dtype}")
    payload, scales = _views(buf, layout)
    out = torch.empty((buf.shape[0], *layout.payload_shape), dtype=dtype, device=buf.device)
    for block in range(buf.shape[0]):
        block_src, block_dst = _groups(payload[block]), _groups(out[block])
        block_scales = None if scales is None else scales[block].view(-1)
        for rows in _row_chunks(layout):
            src = block_src[rows]
            block_dst[rows] = src if block_scales is None else dequantize_fp8(src, block_scales[rows], dtype)
    return out


def _rows_per_chunk(layout: KVBlockLayout) -> int:
    return max(1, (_SERIAL_NUMEL - 1) // (layout.block_size * layout.head_dim))


def _row_chunks(layout: KVBlockLayout) -> list[slice]:
    """Slices of a block's scale groups, each below _SERIAL_NUMEL elements where a group allows."""
    num_groups, step = layout.num_kv_heads * layout.num_layers * 2, _rows_per_chunk(layout)
    return [slice(start, min(start + step, num_groups)) for start in range(0, num_groups, step)]


def _groups(block: torch.Tensor) -> torch.Tensor:
    """One block ``[kv_heads, layers, 2, block_size, head_dim]`` as ``[groups, block_size * head_dim]``: one row per scale."""
    return block.reshape(-1, block.shape[-2] * block.shape[-1])


def _views(buf: torch.Tensor, layout: KVBlockLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The payload ``[n, *payload_shape]`` and scales ``[n, *scale_shape]`` (None without) viewing ``buf``."""
    num_blocks = buf.shape[0]
    payload = buf[:, : layout.payload_bytes].view(STORAGE_DTYPES[layout.kv_dtype])
    payload = payload.view(num_blocks, *layout.payload_shape)
    if not layout.has_scales:
        return payload, None
    trailer = buf[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes]
    return payload, trailer.view(torch.float32).view(num_blocks, *layout.scale_shape)


def _padding(layout: KVBlockLayout) -> list[range]:
    """Byte ranges of a block that hold neither payload nor scales."""
    end_of_scales = layout.scales_offset + layout.scale_bytes
    gaps = [range(layout.payload_bytes, layout.scales_offset), range(end_of_scales, layout.block_bytes)]
    return [gap for gap in gaps if len(gap)]


def _check_kv(kv: torch.Tensor, layout: KVBlockLayout) -> None:
    if kv.dim() != 6 or tuple(kv.shape[1:]) != layout.payload_shape:
        raise ValueError(
            f"kv: expected shape [n, {', '.join(map(str, layout.payload_shape))}] "
            f"([n, kv_heads, layers, 2, block_size, head_dim]), got {list(kv.shape)}"
        )
    if kv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kv: must be float32, bfloat16 or float16, got {kv.dtype}")


def _check_blocks(buf: torch.Tensor, layout: KVBlockLayout, name: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.block_bytes:
        raise ValueError(
            f"{name}: expected uint8 [n, {layout.block_bytes}] (layout.block_bytes), got {buf.dtype} {list(buf.shape)}"
        )
    if not buf.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (a run of whole blocks), got strides {buf.stride()}")
