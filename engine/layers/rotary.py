"""Rotary position embeddings (HF rotate-half convention), with linear, llama3 and YaRN scaling."""

from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2], attention_factor)`` for the configured scaling type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings or 8192
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings or max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for positions ``[0, max_positions)``, applied per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, max_position_embeddings: int) -> None:
        super().__init__()
        self._args = (rope, head_dim, max_position_embeddings)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.register_buffer("signed_sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after the module was materialized from meta."""
        with torch.device("cpu"):
            inv_freq, attention_factor = inverse_frequencies(*self._args)
            freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            self.cos = angles.cos() * attention_factor
            self.sin = angles.sin() * attention_factor
            half = self.sin.shape[-1] // 2
            self.signed_sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` rows for ``positions``, shaped ``[tokens, 1, head_dim]`` to broadcast
        over heads; ``signed_sin`` has its first half negated (see ``apply_rotary``)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by the tables from ``RotaryEmbedding.tables``.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``: rolling x by half
    gives ``[x2, x1]`` and the sign moves into the table, four ops instead of seven, bit for bit
    the same values (a negation is exact).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
