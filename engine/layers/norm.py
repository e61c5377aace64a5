"""RMSNorm as in Llama: computed in float32, scaled in the input dtype."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
