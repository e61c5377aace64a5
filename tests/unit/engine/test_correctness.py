"""Greedy output equals transformers' ``generate`` on every supported architecture (fp32)."""

import pytest

from tests.tiny_models import TINY_CONFIGS
from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts, run_staggered, transformers_greedy


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_tokens_identical_to_transformers(tiny_checkpoint, name):
    model_dir = tiny_checkpoint(name)
    prompts = random_prompts()
    expected = transformers_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert all(len(e) == GREEDY.max_tokens for e in expected)

    engine = make_engine(model_dir, max_num_batched_tokens=32)
    got = run_staggered(engine, prompts, GREEDY)

    assert got == expected
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_long_prompts_are_prefilled_in_chunks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    [prompt] = random_prompts([100])
    engine.add_request("long", prompt, GREEDY)
    tokens_per_step = []
    while engine.stats().num_computed_prompt_tokens < 100:
        before = engine.stats().num_computed_prompt_tokens
        engine.step()
        tokens_per_step.append(engine.stats().num_computed_prompt_tokens - before)
    assert tokens_per_step == [16, 16, 16, 16, 16, 16, 4]


def test_bfloat16_model_runs_and_mostly_agrees(tiny_llama_dir):
    prompts = random_prompts()
    fp32 = run_staggered(make_engine(tiny_llama_dir), prompts, GREEDY)
    bf16 = run_staggered(make_engine(tiny_llama_dir, dtype="bfloat16", kv_dtype="bf16"), prompts, GREEDY)
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(fp32, bf16))
    assert first_tokens_equal >= 6
