"""The C kernel's weight layout (``engine/quant/_qmatmul.c``), packed once at load, and its call.

Output rows go in tiles of 16 (the last one padded with zero rows); each tile holds its 32-weight
blocks in order, and one block of one tile is contiguous, so a tile streams front to back::

    Q4 block-tile (320 bytes)                        Q8 block-tile (544 bytes)
    4 x 64 bytes: byte 4j+t of vector p =            8 x 64 bytes: byte 4j+t of vector g =
      code(row j, k=4p+t) | code(row j, k=4p+16+t)<<4   q(row j, k=4g+t) + 128
    16 x fp16 d | 16 x fp16 m                        16 x fp16 d

One 64-byte vector holds 4 consecutive input features of each of the 16 rows: the kernel's
VNNI dot adds them into one int32 lane per output row (AVX2 does the same per 32-byte half).
The scales are fp16, as GGUF stores them (exact for Q4_0/Q4_1/Q8_0); ``--weights int4``'s own
scales and mins round to fp16.

The kernel quantizes the activations per 32-block to two int8 planes (``amax / 127``, then the
same for the remainder: about 15 bits of ``x``) and is exact in its integer dots, so its result
is ``x @ dequantize().T`` up to that rounding of ``x`` and float32 sums. ``planes=1`` keeps the
first plane only (llama.cpp's 8-bit activations): half the integer dots, ~1% more perplexity.
"""

from __future__ import annotations

import torch  # before the extension: its libgomp is the one the extension's OpenMP binds to

from engine.quant.blocks import GROUP_SIZE

try:
    from engine.quant import _qmatmul
except ImportError:  # not built (no compiler at install): kernels.py runs torch's int4 kernel
    _qmatmul = None

NATIVE_QMATMUL = _qmatmul is not None and _qmatmul.isa() != "scalar"
"""Whether quantized weights run the C kernel: built (setup.py; tests require it where
``SPLITSERVE_REQUIRE_NATIVE=1``) and on a CPU with AVX-512 VNNI or AVX2 (with FMA and F16C).
On the 2-core AVX2 box (no AVX-512) the AVX2 path took 0.2-0.5x the time of the fallback
(``kernels.py`` with this off) per SmolLM2 matmul at 1-16 rows (engine/README.md). The portable
scalar path computes the same bits but is slower than torch's int4 kernel, so it is kept for
tests."""

CPU_BF16 = _qmatmul is not None and _qmatmul.cpu_has_bf16()
"""Whether the CPU multiplies bf16 itself (AVX512-BF16 or AMX). Only then does a bf16 GEMM on a
dense copy beat the C kernel at many rows (prompt chunks). Without, torch widens bf16 first: on
the AVX2 EPYC (2 threads) a 512-row 576x1536 bf16 matmul took 54 ms, the AVX2 kernel 8.2 and
float32 6.5, so native weights there keep no dense copy and run every row count through the kernel."""

TILE_ROWS = 16
Q4_TILE_BYTES = 320
Q8_TILE_BYTES = 544
_F16_MAX = torch.finfo(torch.float16).max


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """uint8 block-tiles of ``w = scales * codes + mins``: ``codes`` 0..15 ``[out, in]``,
    ``scales`` and ``mins`` ``[out, in / 32]`` (rounded to fp16)."""
    tiles, num_blocks, padded = _tiling(codes, scales, mins)
    codes, scales, mins = padded
    grouped = codes.to(torch.uint8).view(tiles, TILE_ROWS, num_blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, num_blocks, 8, 64)
    nibbles = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)
    parts = (nibbles.reshape(tiles, num_blocks, 256), _tile_scales(scales, tiles), _tile_scales(mins, tiles))
    return torch.cat(parts, dim=-1).reshape(-1)


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 block-tiles of ``w = scales * codes``: ``codes`` int8 ``[out, in]``, ``scales``
    ``[out, in / 32]`` (rounded to fp16)."""
    tiles, num_blocks, (codes, scales) = _tiling(codes, scales)
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    grouped = unsigned.view(tiles, TILE_ROWS, num_blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, num_blocks, 512)
    return torch.cat((grouped, _tile_scales(scales, tiles)), dim=-1).reshape(-1)


def dequantize_q4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """float32 ``[out, in]``: ``d * q + m`` read back from the block-tiles, as the kernel sees them."""
    tiles, num_blocks = _tile_counts(shape)
    blocks = packed.view(tiles, num_blocks, Q4_TILE_BYTES)
    nibbles = blocks[..., :256].reshape(tiles, num_blocks, 4, 64)
    grouped = torch.cat((nibbles & 15, nibbles >> 4), dim=2)
    codes = _untile_codes(grouped, shape)
    return _scaled(codes, _untile_scales(blocks[..., 256:288], shape)) + _untile_scales(blocks[..., 288:320], shape).repeat_interleave(GROUP_SIZE, 1)


def dequantize_q8(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """float32 ``[out, in]``: ``d * q`` read back from the block-tiles."""
    tiles, num_blocks = _tile_counts(shape)
    blocks = packed.view(tiles, num_blocks, Q8_TILE_BYTES)
    codes = _untile_codes(blocks[..., :512].reshape(tiles, num_blocks, 8, 64), shape).float() - 128
    return _scaled(codes, _untile_scales(blocks[..., 512:], shape))


def q4_matmul(x: torch.Tensor, packed: object, out_features: int, planes: int = 2) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype; ``packed`` is ``pack_q4(...).numpy()`` (kept by the caller)."""
    return _call(_qmatmul.q4_matmul, x, packed, out_features, planes)


def q8_matmul(x: torch.Tensor, packed: object, out_features: int, planes: int = 2) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype; ``packed`` is ``pack_q8(...).numpy()``."""
    return _call(_qmatmul.q8_matmul, x, packed, out_features, planes)


def _call(kernel, x: torch.Tensor, packed: object, out_features: int, planes: int) -> torch.Tensor:
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = torch.empty(x.shape[0], out_features)
    kernel(x32.numpy(), packed, y.numpy(), planes)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _tiling(codes: torch.Tensor, *scales: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """Tile and block counts, and the tensors padded to whole tiles (scales as fp16)."""
    out_features, in_features = codes.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"the native kernel needs input features in whole groups of {GROUP_SIZE}, got {in_features}")
    for s in scales:
        if not bool((s.abs() <= _F16_MAX).all()):
            raise ValueError(f"a scale or min beyond float16's range ({s.abs().max().item():.3g}) for the native kernel")
    pad = -out_features % TILE_ROWS
    padded = [torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (codes, *(s.to(torch.float16) for s in scales))]
    return (out_features + pad) // TILE_ROWS, in_features // GROUP_SIZE, padded


def _tile_counts(shape: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // TILE_ROWS), shape[1] // GROUP_SIZE


def _tile_scales(scales: torch.Tensor, tiles: int) -> torch.Tensor:
    """fp16 ``[tiles * 16, blocks]`` -> bytes ``[tiles, blocks, 32]``: a block's 16 rows side by side."""
    return scales.view(tiles, TILE_ROWS, -1).permute(0, 2, 1).contiguous().view(torch.uint8)


def _untile_scales(raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    tiles, num_blocks = _tile_counts(shape)
    return raw.contiguous().view(torch.float16).permute(0, 2, 1).reshape(tiles * TILE_ROWS, num_blocks)[: shape[0]].float()


def _untile_codes(grouped: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``[tiles, blocks, 8, 64]`` code vectors -> ``[out, in]``."""
    tiles, num_blocks = _tile_counts(shape)
    codes = grouped.reshape(tiles, num_blocks, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    return codes.reshape(tiles * TILE_ROWS, shape[1])[: shape[0]]


def _scaled(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.repeat_interleave(GROUP_SIZE, 1)
