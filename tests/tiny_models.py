"""Tiny random checkpoints made with transformers, so engine output can be checked against it.

transformers' default init (std 0.02) leaves top-2 logit margins around 0.04: four orders of
magnitude above float32 rounding, so exact greedy comparisons are stable.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB = 512
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Large language models predict the next token from a prefix of tokens.",
    "KV caches store keys and values for every layer and head.",
] * 20
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-kv3": ("LlamaConfig", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192}),
    "llama-rope-llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-rope-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}),
}


def make_tiny_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE tokenizer of TINY_VOCAB tokens trained on a fixed corpus, with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": _CHAT_TEMPLATE})
    )
    return out_dir


def make_tiny_checkpoint(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Save a random ``name`` model (a key of TINY_CONFIGS) with the tiny tokenizer."""
    import transformers

    config_cls, overrides = TINY_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out_dir / f)
    return out_dir
