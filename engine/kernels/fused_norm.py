"""Fused elementwise kernels of a decoder layer on the device path: residual add + RMSNorm, SiLU-and-mul.

Each is one launch where the model's torch code is three to six: ``add_rms_norm`` adds the
residual, stores the sum back into it and normalizes the sum, one program per row;
``silu_and_mul`` gates the fused gate/up projection's output. Both round exactly as the
model's torch code does in its dtype (``engine/layers/norm.py``, ``engine/layers/mlp.py``),
so swapping them in changes no token.

Rounding to bfloat16 is done by hand (``round_to_bf16``), not with ``.to(tl.bfloat16)``:
Triton's interpreter truncates float32 to bfloat16 where a GPU rounds to nearest even, and the
kernels must give the same bits in both.

``reference_add_rms_norm`` and ``reference_silu_and_mul`` are the torch references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import launches
from engine.kernels.triton_common import check_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the serving image runs without Triton; only the kernels need it
    triton = None

_DTYPES = (torch.float32, torch.bfloat16)
_SILU_BLOCK = 1024
"""Columns of the output one SiLU-and-mul program takes (at most)."""

if triton is not None:

    @triton.jit
    def round_to_bf16(x):
        """float32 ``x`` rounded to the nearest bfloat16 (ties to even), still as float32 (NaN aside)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
        HAS_RESIDUAL: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
            if BF16:
                x = round_to_bf16(x)
            tl.store(residual_ptr + row * hidden + cols, x.to(residual_ptr.dtype.element_ty), mask=ok)
        mean_square = tl.sum(x * x, axis=0) / hidden
        normed = x * tl.rsqrt(mean_square + eps)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if BF16:
            out = round_to_bf16(weight * round_to_bf16(normed))
        else:
            out = normed * weight
        tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(gate_up_ptr, out_ptr, intermediate, BF16: tl.constexpr, PRECISE_EXP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < intermediate
        gate = tl.load(gate_up_ptr + row * 2 * intermediate + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * intermediate + intermediate + cols, mask=ok, other=0.0).to(tl.float32)
        if PRECISE_EXP:  # torch's CUDA silu calls expf; tl.exp would be the faster ex2.approx
            silu = tl.div_rn(gate, 1.0 + libdevice.exp(-gate))
        else:
            silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
        if BF16:
            out = round_to_bf16(round_to_bf16(silu) * up)
        else:
            out = silu * up
        tl.store(out_ptr + row * intermediate + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = x + residual``, written into ``residual`` in place.

    ``x`` and ``residual``: ``[tokens, hidden]``, float32 or bfloat16, one dtype; ``weight``:
    ``[hidden]`` in that dtype. With ``residual`` None, ``s`` is ``x`` itself (returned as it is,
    unmodified). The norm is ``RMSNorm.forward``'s: the mean of squares in float32; in bfloat16
    the normalized row is rounded before the weight multiplies it. One launch.
    """
    _require_triton("add_rms_norm")
    _check_norm_inputs(x, residual, weight, eps)
    check_device("add_rms_norm", x)
    rows = x.contiguous()
    out = torch.empty_like(rows)
    tokens, hidden = x.shape
    if tokens:
        launches.record("add_rms_norm")
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(tokens,)](
            rows, residual if residual is not None else rows, weight.contiguous(), out, hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BF16=x.dtype == torch.bfloat16, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),  # a whole row per program: spread wide rows over more threads
        )
    return out, residual if residual is not None else x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up = [gate | up]`` (``[tokens, 2 * I]``), as ``[tokens, I]``.

    float32 or bfloat16; rounded as torch rounds it: the SiLU to the dtype, then the product. One launch.
    """
    _require_triton("silu_and_mul")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [tokens, 2 * intermediate], got {list(gate_up.shape)}")
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"gate_up: dtype must be float32 or bfloat16, got {gate_up.dtype}")
    check_device("silu_and_mul", gate_up)
    gate_up = gate_up.contiguous()
    tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    block = min(_SILU_BLOCK, triton.next_power_of_2(max(intermediate, 1)))
    if tokens and intermediate:
        launches.record("silu_and_mul")
        _silu_and_mul_kernel[(tokens, triton.cdiv(intermediate, block))](
            gate_up, out, intermediate,
            BF16=gate_up.dtype == torch.bfloat16, PRECISE_EXP=gate_up.device.type == "cuda", BLOCK=block,
        )
    return out


def reference_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` in torch ops, ``residual`` updated in place the same way."""
    _check_norm_inputs(x, residual, weight, eps)
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    out = normed * weight if x.dtype == torch.float32 else weight * normed.to(x.dtype)
    return out, x


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` in torch ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _require_triton(kernel: str) -> None:
    if triton is None:
        raise RuntimeError(f"{kernel} needs Triton (pip install the test extras, or triton on a GPU host)")


def _check_norm_inputs(x, residual, weight, eps) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected [tokens, hidden], got {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype must be float32 or bfloat16, got {x.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual: expected {x.dtype} {list(x.shape)} like x, got {residual.dtype} {list(residual.shape)}")
        if not residual.is_contiguous():
            raise ValueError("residual: must be contiguous (it is updated in place)")
        if residual.device != x.device:
            raise ValueError(f"residual: on {residual.device}, x on {x.device}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected {x.dtype} [{x.shape[1]}], got {weight.dtype} {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: on {weight.device}, x on {x.device}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
