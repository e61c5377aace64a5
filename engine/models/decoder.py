"""Decoder-only transformer shared by every supported architecture.

Llama, Mistral, Qwen2 and Qwen3 differ only in flags the config carries (QKV bias, per-head
q/k norm, tied embeddings); Mixtral and Qwen-MoE swap the MLP for a sparse MoE block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention import AttentionBatch, PagedAttention
from engine.layers.mlp import GatedMLP, SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention then pre-norm MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is None:
            self.mlp: torch.nn.Module = GatedMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = SparseMoE(config.hidden_size, config.moe)

    def forward(self, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class VocabEmbedding(torch.nn.Module):
    """Token embedding table; its weight is always loaded, so it is never randomly initialized."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class DecoderModel(torch.nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward works on a flat token batch."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, config.max_position_embeddings)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def empty(cls, config: ModelConfig, max_positions: int, dtype: torch.dtype) -> DecoderModel:
        """A model with uninitialized weights (no time spent on random init), ready for load_weights."""
        with torch.device("meta"):
            model = cls(config, max_positions)
        model.to_empty(device="cpu")
        model.to(dtype)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.reset_tables()
        return model.eval()

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of a flat batch of tokens."""
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, batch)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows of ``hidden`` that will be sampled."""
        return self.lm_head(hidden).float()
