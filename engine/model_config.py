"""The architecture facts the engine needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, UnsupportedModelError

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, in the union of the HF v4 and v5 spellings."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MoE block: routed experts, optional always-on shared expert."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    """0 when the model has no shared expert."""
    checkpoint_style: str = "qwen"
    """Weight names: "mixtral" (block_sparse_moe.experts.N.w1/w2/w3) or "qwen" (mlp.experts.N.*_proj)."""


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only model's shape, as the engine builds it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    moe: MoEConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, checkpoint_dir: Path) -> ModelConfig:
        path = Path(checkpoint_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{checkpoint_dir}: no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if raw.get("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        if arch not in DENSE_ARCHITECTURES + MOE_ARCHITECTURES:
            supported = ", ".join(DENSE_ARCHITECTURES + MOE_ARCHITECTURES)
            raise UnsupportedModelError(f"{source}: architecture {arch!r} is not supported (supported: {supported})")
        try:
            num_heads = raw["num_attention_heads"]
            hidden = raw["hidden_size"]
            head_dim = raw.get("head_dim") or hidden // num_heads
            eos = raw.get("eos_token_id")
            return cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=hidden,
                intermediate_size=raw.get("intermediate_size", 0),
                num_layers=raw["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=head_dim,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope=_rope_config(raw, source),
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                qkv_bias=arch.startswith("Qwen2") or raw.get("attention_bias", False),
                o_bias=raw.get("attention_bias", False) and not arch.startswith("Qwen2"),
                qk_norm=arch.startswith("Qwen3"),
                moe=_moe_config(arch, raw) if arch in MOE_ARCHITECTURES else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
                sliding_window=_sliding_window(raw),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from e


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"),
    )


def _moe_config(arch: str, raw: dict[str, Any]) -> MoEConfig:
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            expert_intermediate_size=raw["intermediate_size"],
            norm_topk_prob=True,
            checkpoint_style="mixtral",
        )
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{arch}: dense layers mixed into the MoE stack are not supported")
    return MoEConfig(
        num_experts=raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        expert_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM"),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0,
    )


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    return int(window)
