"""FP8 (e4m3) quantization with one dynamic scale per group.

``scale = amax / 448``; values are divided by the scale, clamped to ±448 and only then cast,
because e4m3 casts disagree across libraries above 464 and at inf. A group whose amax is 0 gets
scale 1 so that dequantization never divides by zero.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def fp8_scales(x: torch.Tensor, num_group_dims: int) -> torch.Tensor:
    """float32 scales, one per group; a group is everything after the first ``num_group_dims`` dims."""
    flat = x.reshape(*x.shape[:num_group_dims], -1)
    amax = flat.abs().amax(dim=-1).float()
    scales = amax / FP8_E4M3_MAX
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Cast ``x / scales`` to e4m3, saturating at ±448; ``scales`` broadcasts over the group dims."""
    scaled = x.float() / _expand(scales, x.dim())
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8, in ``dtype``."""
    return (q.to(torch.float32) * _expand(scales, q.dim())).to(dtype)


def _expand(scales: torch.Tensor, ndim: int) -> torch.Tensor:
    return scales.reshape(*scales.shape, *([1] * (ndim - scales.dim())))
