"""Shared helpers for engine tests: building engines, driving them, transformers references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.params import SamplingParams
from engine.quant import native
from tests.native import built_or_skip

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = (1, 5, 16, 17, 33, 40, 70, 100)


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    kwargs = dict(model=str(model_dir), kv_dtype="fp32", num_kv_blocks=256, max_num_batched_tokens=32)
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs))


def random_prompts(lengths=PROMPT_LENGTHS, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], every: int = 2) -> list[tuple[int, ...]]:
    """Add one prompt every ``every`` steps, so requests join while others are mid-decode;
    ``params`` is every prompt's, or a list of one per prompt."""
    ids = [f"r{i}" for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: set[str] = set()
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    assert len(per_prompt) == len(prompts)
    pending = list(zip(ids, prompts, per_prompt))
    step = 0
    while len(finished) < len(ids):
        if pending and step % every == 0:
            rid, prompt, prompt_params = pending.pop(0)
            engine.add_request(rid, prompt, prompt_params)
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
        step += 1
    return [tuple(outputs[rid]) for rid in ids]


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[int, ...]]:
    """transformers' own greedy ``generate``, one prompt at a time (no padding), fp32, EOS ignored."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(tuple(gen[0, len(prompt) :].tolist()))
    return out


@pytest.fixture
def native_qmatmul(monkeypatch):
    """The C extension engine.quant._qmatmul, with quantized weights built for it (also on a CPU
    where only its scalar path runs)."""
    built_or_skip(native._qmatmul, "engine.quant._qmatmul", "gcc with OpenMP (libgomp)", "quantized weights run torch's int4 kernel")
    monkeypatch.setattr(native, "NATIVE_QMATMUL", True)
    return native._qmatmul


def attention_model_config(num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int) -> ModelConfig:
    """A Llama config for attention tests: only the head counts, head size and layers matter."""
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": num_heads * head_dim,
            "intermediate_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
        }
    )
