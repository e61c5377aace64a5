"""Linear weights in the layouts of the quantized CPU kernels.

Each class answers ``matmul(x) = x W^T`` in ``x``'s dtype and picks its kernel per call by the
number of rows: the quantized kernels stream 4-8x fewer weight bytes than bf16, which wins
while a matmul is bound by reading the weight (decode steps of a few rows); past a few rows the
kernels' arithmetic costs more than the bytes saved, and a dense bf16 copy (dequantized once
at load, memory being plentiful on a CPU host) runs instead.

The group-32 formats (``Int4Weight``, ``GroupInt8Weight``) run the C kernel of
``engine/quant/native.py`` where it is built (``NATIVE_QMATMUL``): int8 dot products on float32
activations quantized per 32-block to two int8 planes (about 15 bits; ``act_planes = 1`` keeps
one, as llama.cpp does), no bf16 round trip. Elsewhere they run torch's
``_weight_int4pack_mm_for_cpu``, which wants bf16 activations (float32 ones run about 10x
slower), so ``x`` is cast to bf16 and back; ``cast_back=False`` skips the cast back for a caller
whose next op promotes the bf16 result exactly (adding it to a float32 residual).

Measured on the 2-core dev box (``python -m bench.kernels``, figures in engine/README.md): per
matmul the native kernel and the bf16 copy trade places between 24 and 64 rows at 2 threads on
SmolLM2's shapes (the LM head favours the kernel, the 576x1536 down projection the copy); a whole
decode step at 32 sequences took 60.9 ms with the kernel up to 32 rows against 70.6 ms with the
copy past 24, so the limit is 32 (torch's int4 kernel, the fallback, wins up to about 16);
torch's int8 kernel beats bf16 up to about 6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant import native
from engine.quant.blocks import GROUP_SIZE, BlockQuant

INT4_KERNEL_MAX_ROWS = 32
"""Most rows a matmul sends to the 4-bit kernel; more go to the dense bf16 copy, which native
weights keep only on a CPU that multiplies bf16 itself (``native.CPU_BF16``): elsewhere the C
kernel takes every row count."""
GROUP_INT8_KERNEL_MAX_ROWS = 32
"""Most rows a matmul sends to the group-32 int8 kernel; more go to the dense bf16 copy (as above)."""
TORCH_INT4_KERNEL_MAX_ROWS = 16
"""The same limit for both group-32 formats where they run torch's int4 kernel (the fallback)."""
INT8_KERNEL_MAX_ROWS = 4
"""Most rows a matmul sends to the per-row int8 kernel; more go to the dense bf16 copy."""
_INT4_ROW_MULTIPLE = 16
_INT4_MID = 8  # torch's int4 kernel dequantizes w = (q - 8) * scale + zero


class DenseWeight:
    """A plain weight kept in its own dtype (bf16 weights in a float32 model run in bf16)."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()

    def matmul(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        y = F.linear(x.to(self.weight.dtype), self.weight)
        return y.to(x.dtype) if cast_back else y

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: the weight as the kernel sees it."""
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads."""
        return self.weight.nbytes


class Int4Weight:
    """Group-32 4-bit weight: ``w = scale * q + min`` per 32 input features, q in 0..15.

    Native: the C kernel's Q4 block-tiles (``native.pack_q4``; fp16 scale and min). Fallback:
    torch's ``_weight_int4pack_mm_for_cpu`` layout, codes two per byte and bf16
    ``scales_and_zeros`` ``[in / 32, out, 2]`` with ``zero = min + 8 * scale``.
    """

    kind = "int4"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dense_copy: bool = True) -> None:
        """``codes`` 0..15 ``[out, in]``; ``scales``, ``mins`` float32 ``[out, in / 32]``;
        ``dense_copy`` False skips the bf16 copy (a caller that keeps its own); native weights
        keep none either where the CPU lacks bf16 (``native.CPU_BF16``)."""
        self.shape = tuple(codes.shape)
        self.native = native.NATIVE_QMATMUL  # read per weight: a test may switch it off
        self.act_planes = 2  # the C kernel's int8 planes of x: 1 or 2 (EngineConfig.act_planes)
        if self.native:
            self.packed = native.pack_q4(codes, scales, mins)
            self._packed_array = self.packed.numpy()
            self.dense = self.dequantize().to(torch.bfloat16) if dense_copy and native.CPU_BF16 else None
        else:
            scales, zeros = scales.to(torch.bfloat16), (mins + _INT4_MID * scales).to(torch.bfloat16)
            self.dense = _dequantize_int4(codes, scales, zeros).to(torch.bfloat16) if dense_copy else None
            self._pack_for_torch(codes, scales, zeros)

    def _pack_for_torch(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        pad = -codes.shape[0] % _INT4_ROW_MULTIPLE  # the packing wants whole tiles of 16 rows
        if pad:
            codes, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scales, zeros))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.scales_and_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).contiguous()

    @classmethod
    def from_blocks(cls, blocks: BlockQuant) -> Int4Weight:
        """Q4_0 / Q4_1 blocks as they are: the same codes, ``d`` as the scale."""
        return cls(blocks.codes, blocks.scales, int4_mins(blocks))

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int4Weight:
        """Quantize ``[out, in]`` (in a multiple of 32): per group, 16 levels from its min to its max."""
        out_features, in_features = weight.shape
        if in_features % GROUP_SIZE:
            raise ValueError(f"int4 needs input features in whole groups of {GROUP_SIZE}, got {in_features}")
        groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(codes.reshape(out_features, in_features), scales, low)

    def matmul(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > (INT4_KERNEL_MAX_ROWS if self.native else TORCH_INT4_KERNEL_MAX_ROWS):
            y = F.linear(x.to(torch.bfloat16), self.dense)
        elif self.native:
            return self.kernel(x)  # float32 in, x's dtype out: no cast either way
        else:
            y = self.kernel(x.to(torch.bfloat16))
        return y.to(x.dtype) if cast_back else y

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` through the 4-bit kernel alone, whatever the rows (bf16 ``x`` on torch's)."""
        if self.native:
            return native.q4_matmul(x, self._packed_array, self.shape[0], self.act_planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y if y.shape[1] == self.shape[0] else y[:, : self.shape[0]]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]`` as the kernel sees it: read back from the native layout, or a
        matmul of torch's kernel with the identity."""
        if self.native:
            return native.dequantize_q4(self.packed, self.shape)
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return out[:, : self.shape[0]].t().float()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.native else self.scales_and_zeros.nbytes)


class Int8Weight:
    """Symmetric per-output-channel int8 weight: ``w = q * scale[row]`` (``_weight_int8pack_mm``)."""

    kind = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.shape = tuple(codes.shape)
        self.codes = codes.contiguous()
        self.scales = scales.to(torch.bfloat16)
        self.dense = self.dequantize().to(torch.bfloat16)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int8Weight:
        """Quantize ``[out, in]`` with one scale per row (``quantize_per_row``)."""
        return cls(*quantize_per_row(weight))

    def matmul(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        if x.shape[0] > INT8_KERNEL_MAX_ROWS:
            y = F.linear(x.to(torch.bfloat16), self.dense)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)
        return y.to(x.dtype) if cast_back else y

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class GroupInt8Weight:
    """8-bit codes with one scale per 32 input features (GGUF's Q8_0): ``w = scale * q``.

    Native: the C kernel's Q8 block-tiles (``native.pack_q8``; fp16 scale). Fallback: torch's
    int8 kernel takes one scale per row and streams a wide matrix slowly at one row of
    activations (the 49152 x 576 LM head: 12 ms against 1.5 ms for int4, measured alone on the
    dev box), so the weight runs as two int4 matmuls. Splitting ``u = q + 128`` into nibbles,
    ``u = 16 hi + lo``, gives ``d q = 16 d hi + d lo - 128 d``: two int4 weights (scales ``16 d``
    and ``d``, mins ``-128 d`` and 0) whose sum is the block's exact value (``d`` rounded to
    bf16), at 8 bits per weight in two passes of the fast kernel.
    """

    kind = "int8"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """``codes`` int8 ``[out, in]``; ``scales`` float32 ``[out, in / 32]``."""
        self.shape = tuple(codes.shape)
        self.native = native.NATIVE_QMATMUL  # read per weight: a test may switch it off
        self.act_planes = 2  # the C kernel's int8 planes of x: 1 or 2 (EngineConfig.act_planes)
        if self.native:
            self.packed = native.pack_q8(codes, scales)
            self._packed_array = self.packed.numpy()
        else:
            scales = scales.to(torch.bfloat16).float()
            unsigned = codes.to(torch.int32) + 128
            self.high = Int4Weight(unsigned >> 4, 16 * scales, -128 * scales, dense_copy=False)
            self.low = Int4Weight(unsigned & 15, scales, torch.zeros_like(scales), dense_copy=False)
        self.dense = None
        if not self.native or native.CPU_BF16:
            groups = codes.view(self.shape[0], -1, GROUP_SIZE).float() * (scales.half() if self.native else scales).float()[..., None]
            self.dense = groups.view(self.shape).to(torch.bfloat16)

    @classmethod
    def from_blocks(cls, blocks: BlockQuant) -> GroupInt8Weight:
        """Q8_0 blocks as they are."""
        if blocks.kind != "Q8_0":
            raise ValueError(f"GGUF type {blocks.kind} is not Q8_0")
        return cls(blocks.codes, blocks.scales)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> GroupInt8Weight:
        """Symmetric int8 with one scale per row (``quantize_per_row``)."""
        return cls.from_per_row(*quantize_per_row(weight))

    @classmethod
    def from_per_row(cls, codes: torch.Tensor, scales: torch.Tensor) -> GroupInt8Weight:
        """Per-row int8 ``codes`` and ``scales`` (``[out]``), each group carrying its row's scale."""
        groups = codes.shape[1] // GROUP_SIZE
        return cls(codes, scales.float()[:, None].expand(-1, groups).contiguous())

    def matmul(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        """``cast_back`` is accepted for the common interface; the result is in ``x``'s dtype."""
        if self.dense is not None and x.shape[0] > (GROUP_INT8_KERNEL_MAX_ROWS if self.native else TORCH_INT4_KERNEL_MAX_ROWS):
            return F.linear(x.to(torch.bfloat16), self.dense).to(x.dtype)
        if self.native:
            return native.q8_matmul(x, self._packed_array, self.shape[0], self.act_planes)
        x16 = x.to(torch.bfloat16)
        return (self.high.kernel(x16).float() + self.low.kernel(x16).float()).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]`` as the kernel sees it."""
        if self.native:
            return native.dequantize_q8(self.packed, self.shape)
        return self.high.dequantize() + self.low.dequantize()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.native else self.high.nbytes + self.low.nbytes


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of ``[out, in]``, one scale per row (``amax / 127``), the
    scale rounded to bf16 (torch's int8 kernel multiplies by the bf16 scale)."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scales = scales.to(torch.bfloat16).float()
    codes = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def _dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    groups = codes.shape[1] // GROUP_SIZE
    w = (codes.view(codes.shape[0], groups, GROUP_SIZE).float() - _INT4_MID) * scales.float()[..., None] + zeros.float()[..., None]
    return w.view(codes.shape)


def int4_mins(blocks: BlockQuant) -> torch.Tensor:
    """``min`` per block of a Q4_0 / Q4_1 weight written as ``w = d * q + min``."""
    if blocks.kind == "Q4_0":  # d * (q - 8)
        return -_INT4_MID * blocks.scales
    if blocks.kind == "Q4_1":  # d * q + m
        return blocks.mins
    raise ValueError(f"GGUF type {blocks.kind} is not 4-bit")


QuantizedWeight = DenseWeight | Int4Weight | Int8Weight | GroupInt8Weight
