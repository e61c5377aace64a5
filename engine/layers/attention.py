"""Causal self-attention over the paged KV cache.

One forward step mixes sequences in decode (one new token each) with chunks of prompts being
prefilled. All tokens of the step go through the projections together; attention then runs per
decode group (sequences of similar context length, padded within the group) and per prefill
chunk. New K/V are written to the cache first, so every query reads its whole context from the
cache (including its own chunk), which keeps prefill and decode on one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import PagedKVCache
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended together; tables padded to the group's longest context."""

    token_index: torch.Tensor
    """[batch] positions of the group's tokens in the step's flat token batch."""
    block_tables: torch.Tensor
    """[batch, num_blocks] block ids, padded with any valid id."""
    mask: torch.Tensor
    """[batch, 1, 1, num_blocks * block_size] True where the key is inside the context."""


@dataclass(frozen=True)
class PrefillChunk:
    """A run of consecutive prompt tokens of one sequence."""

    token_start: int
    """First position of the chunk in the step's flat token batch."""
    num_tokens: int
    block_table: torch.Tensor
    """[1, num_blocks] every block of the sequence up to the chunk's end."""
    mask: torch.Tensor
    """[num_tokens, num_blocks * block_size] causal mask in absolute positions."""


@dataclass(frozen=True)
class AttentionBatch:
    """Everything attention needs for one step, built once per step by the model runner."""

    kv_cache: PagedKVCache
    slot_block_ids: torch.Tensor
    """[num_tokens] block each new token's K/V goes to."""
    slot_offsets: torch.Tensor
    """[num_tokens] offset within that block."""
    decode_groups: tuple[DecodeGroup, ...]
    prefill_chunks: tuple[PrefillChunk, ...]


class PagedAttention(torch.nn.Module):
    """QKV projection, optional per-head q/k norm (Qwen3), RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = torch.nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = torch.nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        batch.kv_cache.write(self.layer_index, k, v, batch.slot_block_ids, batch.slot_offsets)
        out = torch.empty_like(q)
        for group in batch.decode_groups:
            out[group.token_index] = self._decode(q[group.token_index], group, batch.kv_cache)
        for chunk in batch.prefill_chunks:
            span = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[span] = self._prefill(q[span], chunk, batch.kv_cache)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _decode(self, q: torch.Tensor, group: DecodeGroup, kv_cache: PagedKVCache) -> torch.Tensor:
        # One query per sequence: fold the query heads of each KV head into the "query length"
        # axis, so GQA needs neither repeated K/V nor enable_gqa.
        k, v = kv_cache.gather(self.layer_index, group.block_tables)
        grouped = q.view(q.shape[0], self.num_kv_heads, -1, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=group.mask)
        return out.reshape(q.shape)

    def _prefill(self, q: torch.Tensor, chunk: PrefillChunk, kv_cache: PagedKVCache) -> torch.Tensor:
        k, v = kv_cache.gather(self.layer_index, chunk.block_table)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=chunk.mask, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)
