"""GGUF's 32-weight quantization blocks, unpacked into codes and per-block scales.

llama.cpp stores a quantized row as consecutive blocks of 32 weights (``QK = 32``)::

    Q4_0  (18 bytes)  d:f16 | 16 bytes of nibbles          w = d * (q - 8),  q in 0..15
    Q4_1  (20 bytes)  d:f16 | m:f16 | 16 bytes of nibbles  w = d * q + m,    q in 0..15
    Q8_0  (34 bytes)  d:f16 | 32 x int8                    w = d * q,        q in -128..127

In the nibble bytes, byte j holds weight j in its low half and weight j + 16 in its high half.
``BlockQuant`` keeps the codes as they are and the scales widened to float32 (exact: every f16
is a float32), so dequantizing it reproduces gguf's own ``dequantize`` bit for bit, and the
kernels' layouts are built from it (``engine/quant/kernels.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
"""Weights per GGUF block, and the group size of our int4 layout: one scale per block maps onto one group."""
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class BlockQuant:
    """A ``[rows, cols]`` weight in GGUF blocks along its columns (its input features)."""

    kind: str
    """Q4_0, Q4_1 or Q8_0."""
    codes: torch.Tensor
    """uint8 ``[rows, cols]`` (0..15) for the 4-bit kinds, int8 for Q8_0."""
    scales: torch.Tensor
    """float32 ``[rows, cols // 32]``: each block's ``d``."""
    mins: torch.Tensor | None
    """float32 ``[rows, cols // 32]``: each block's ``m`` (Q4_1 only)."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]``, as llama.cpp computes it."""
        rows, cols = self.shape
        codes = self.codes.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        if self.kind == "Q4_0":
            codes = codes - 8
        out = codes * self.scales[..., None]
        if self.mins is not None:
            out = out + self.mins[..., None]
        return out.view(rows, cols)

    def select(self, rows: slice | torch.Tensor, columns: slice) -> BlockQuant:
        """The sub-weight ``[rows, columns]``; ``columns`` must start and stop on block boundaries."""
        start, stop, _ = columns.indices(self.shape[1])
        if start % GROUP_SIZE or (stop % GROUP_SIZE and stop != self.shape[1]):
            raise ValueError(f"columns {start}:{stop} cut a {GROUP_SIZE}-weight {self.kind} block")
        blocks = slice(start // GROUP_SIZE, -(-stop // GROUP_SIZE))
        mins = None if self.mins is None else self.mins[rows, blocks]
        return BlockQuant(self.kind, self.codes[rows, start:stop], self.scales[rows, blocks], mins)

    def permute_rows(self, order: torch.Tensor) -> BlockQuant:
        """The same weight with its rows in ``order`` (row i of the result is row order[i])."""
        return self.select(order, slice(None))


def cat_rows(parts: list[BlockQuant]) -> BlockQuant:
    """Row-wise concatenation of weights of one kind (a fused QKV or gate/up projection)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of different GGUF types {sorted(kinds)}")
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return BlockQuant(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def unpack_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> BlockQuant:
    """Unpack GGUF's raw bytes (``uint8``, any shape holding ``rows * cols`` weights) of one tensor."""
    if kind not in BLOCK_TYPES:
        raise ValueError(f"GGUF type {kind} is not one of {BLOCK_TYPES}")
    if cols % GROUP_SIZE:
        raise ValueError(f"{cols} columns are not whole {GROUP_SIZE}-weight blocks")
    num_blocks = cols // GROUP_SIZE
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, num_blocks, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = None
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    else:
        header = 4 if kind == "Q4_1" else 2
        if kind == "Q4_1":
            mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        nibbles = blocks[..., header:]
        codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    return BlockQuant(kind, torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales), mins)
