"""Decoder-only transformer shared by every supported architecture.

Llama, Mistral, Qwen2 and Qwen3 differ only in flags the config carries (QKV bias, per-head
q/k norm, tied embeddings); Mixtral and Qwen-MoE swap the MLP for a sparse MoE block.

The model is built for one rank of a tensor-parallel group (``TPGroup.single()`` when it is not
split): its layers hold that rank's slice of every weight (``engine/parallel``) and exchange
partial results through the group. The code is the same at every TP size.

In a pipelined replica it is one stage's part (``Stage``, engine/parallel/pipeline.py): the
layers of its run (the others are ``MissingLayer``s, so that parameter names keep the
checkpoint's layer numbers), the embedding only on the first stage, the final norm and LM head
only on the last. A stage's input is the previous stage's hidden stream, its output the stream
after its layers (or, on the last stage, the final hidden states).
"""

from __future__ import annotations

import torch

from engine.kernels.cpu_decoder import FusedLayers, unsupported
from engine.layers.attention import AttentionBatch, PagedAttention
from engine.layers.mlp import GatedMLP, SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from engine.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from engine.parallel.pipeline import Stage
from engine.parallel.sharding import TPShard


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention then pre-norm MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, layer_index: int, shard: TPShard, tp: TPGroup, ep: TPGroup, kv_index: int | None = None) -> None:
        """``kv_index``: where the layer's K/V sit in its stage's KV pool (default ``layer_index``)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, layer_index if kv_index is None else kv_index, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is None:
            self.mlp: torch.nn.Module = GatedMLP(config.hidden_size, shard.intermediate, tp)
        else:
            self.mlp = SparseMoE(config.hidden_size, config.moe, tp, ep)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``: the next layer's norm adds the two, so that on
        the device path each residual add is fused into the norm after it."""
        fused = batch.device is not None
        x, residual = self.input_layernorm.add_forward(hidden, residual, fused)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, batch), residual, fused)
        return self.mlp(x, fused), residual


class MissingLayer(torch.nn.Module):
    """The place of a layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a layer of another pipeline stage was run on this one")


class DecoderModel(torch.nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward works on a flat token batch."""

    fused_layers: FusedLayers | None = None
    """Small steps' layers in C (``bind_fused_layers``); None: always the Python layers."""

    def __init__(self, config: ModelConfig, max_positions: int, tp: TPGroup | None = None, ep: TPGroup | None = None, stage: Stage | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.ep = ep = ep or TPGroup.single()
        self.config = config
        self.stage = stage = stage or Stage.whole(config.num_layers)
        self.shard = shard = TPShard(config, tp.rank, tp.size)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab, config.vocab_size, config.hidden_size, tp) if stage.is_first else None
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, config.max_position_embeddings)
        first = stage.layers.start
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i, shard, tp, ep, kv_index=i - first) if i in stage.layers else MissingLayer() for i in range(config.num_layers)
        )
        self.held_layers = [self.layers[i] for i in stage.layers]
        """This stage's layers, in order (every layer when the replica is not pipelined)."""
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        self.lm_head = ParallelLMHead(shard.vocab, config.vocab_size, config.hidden_size, tp) if stage.is_last else None
        if config.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def empty(
        cls, config: ModelConfig, max_positions: int, dtype: torch.dtype, tp: TPGroup | None = None, ep: TPGroup | None = None, stage: Stage | None = None
    ) -> DecoderModel:
        """A model with uninitialized weights (no time spent on random init), ready for load_weights."""
        with torch.device("meta"):
            model = cls(config, max_positions, tp, ep, stage)
        # Not ``to_empty``: its ``empty_like`` of a meta tensor runs torch's Python reference
        # implementation, whose first call imports sympy (0.3-0.5 s in every rank's process).
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_tokens"):
                buffer.zero_()
        model.to(dtype)
        if config.tie_word_embeddings and model.embed_tokens is not None and model.lm_head is not None:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.reset_tables()
        return model.eval()

    def expert_tokens(self) -> torch.Tensor | None:
        """``int64 [layers, experts held]``: (token, expert) pairs each held expert computed; None for a dense model."""
        counts = [layer.mlp.expert_tokens for layer in self.held_layers if isinstance(layer.mlp, SparseMoE)]
        return torch.stack(counts) if counts else None

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (its slice of the paged KV pool)."""
        return len(self.shard.kv_heads)

    def holds_tensor(self, name: str) -> bool:
        """Whether this stage reads checkpoint tensor ``name`` (a tied embedding is the last stage's LM head too)."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.stage.layers
        if name == "model.embed_tokens.weight":
            return self.stage.is_first or (self.stage.is_last and self.config.tie_word_embeddings)
        if name in ("model.norm.weight", "lm_head.weight"):
            return self.stage.is_last
        return True

    def forward(self, inputs: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of a flat batch of tokens: ``inputs`` are
        token ids on the first stage, the previous stage's hidden stream on the others; a stage
        before the last returns its stream."""
        hidden = self.embed_tokens(inputs) if self.stage.is_first else inputs
        if self.fused_layers is not None and self.fused_layers.covers(batch, hidden.shape[0]):
            hidden = self.fused_layers.run(hidden, batch)
            return self.norm(hidden) if self.stage.is_last else hidden
        residual = None
        for layer in self.held_layers:
            hidden, residual = layer(hidden, residual, batch)
        if not self.stage.is_last:
            return hidden + residual if residual is not None else hidden
        return self.norm.add_forward(hidden, residual, batch.device is not None)[0]

    def bind_fused_layers(self) -> str | None:
        """Bind the loaded weights for small steps' layers in one C call (``engine/kernels/cpu_decoder.py``);
        returns why not where the model does not qualify. Call again after changing weights."""
        reason = unsupported(self)
        self.fused_layers = FusedLayers.of(self) if reason is None else None
        return reason

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits for the rows of ``hidden`` that will be sampled; None on a rank other than the leader."""
        return self.lm_head.logits(hidden)
