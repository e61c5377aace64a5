"""Sampler filters and per-request seeds, on crafted logits and through the engine."""

import math

import torch

from engine.params import GREEDY_BELOW_TEMPERATURE, SamplingParams
from engine.sampler import sample, step_seed
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered

LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


def _draw(params: SamplingParams, n: int = 2000) -> list[int]:
    """``n`` output positions of one request seeded with 0."""
    return [sample(LOGITS, [params], [0], [position])[0] for position in range(n)]


def test_greedy_and_top_k_one_take_the_argmax():
    assert set(_draw(SamplingParams(temperature=0), 50)) == {0}
    assert set(_draw(SamplingParams(top_k=1), 50)) == {0}


def test_top_k_keeps_only_the_k_best():
    assert set(_draw(SamplingParams(top_k=2))) == {0, 1}


def test_a_top_k_beyond_the_vocabulary_keeps_every_token_as_zero_does():
    """Found by the API fuzzer: a top_k above the vocabulary size must not crash the engine."""
    assert _draw(SamplingParams(top_k=1000), 300) == _draw(SamplingParams(top_k=0), 300)
    batch = sample(LOGITS.repeat(2, 1), [SamplingParams(top_k=1000), SamplingParams(top_k=2)], [0, 0], [7, 7])
    assert batch[0] == _draw(SamplingParams(top_k=0), 8)[7] and batch[1] in (0, 1)


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert set(_draw(SamplingParams(top_p=0.5))) == {0, 1}  # 0.4 < 0.5 <= 0.4 + 0.3
    assert set(_draw(SamplingParams(top_p=0.75))) == {0, 1, 2}
    assert set(_draw(SamplingParams(top_p=1e-6), 50)) == {0}


def test_temperature_reshapes_the_distribution():
    draws = _draw(SamplingParams(temperature=2.0), 4000)
    probs = torch.softmax(LOGITS[0] / 2.0, dim=-1).tolist()
    for token, p in enumerate(probs):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws))


def test_seeded_request_is_reproducible_whatever_the_batch(tiny_llama_dir):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    prompts = random_prompts([10, 20, 30])
    engine = make_engine(tiny_llama_dir)
    engine.add_request("alone", prompts[0], seeded)
    [alone] = engine.run_to_completion(["alone"])
    batched = run_staggered(make_engine(tiny_llama_dir), prompts, seeded, every=1)
    assert batched[0] == alone.output_token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    engine.add_request("other", prompts[0], other_seed)
    [other] = engine.run_to_completion(["other"])
    assert other.output_token_ids != alone.output_token_ids


def test_a_draw_depends_only_on_the_seed_and_the_position():
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    batch = sample(logits, [params] * 3, [7, 7, 8], [0, 1, 0])
    alone = [sample(logits[i : i + 1], [params], [seed], [position])[0] for i, (seed, position) in enumerate([(7, 0), (7, 1), (8, 0)])]
    assert batch == alone
    assert len({step_seed(7, 0), step_seed(7, 1), step_seed(8, 0), step_seed(0, 0)}) == 4
    assert all(0 <= step_seed(seed, n) < 2**63 for seed in (0, 2**63 - 1, -5) for n in (0, 10**6))


def test_a_temperature_too_small_to_divide_by_is_greedy():
    # LOGITS / 1e-40 overflows float32 to -inf, and softmax of that is NaN: this used to fail the step.
    assert set(_draw(SamplingParams(temperature=1e-40), 50)) == {0}
    assert set(_draw(SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE / 2, top_p=0.5), 50)) == {0}


def test_an_engine_serves_a_denormal_temperature_as_greedy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    [prompt] = random_prompts([9], seed=3)
    [greedy, tiny] = engine.generate([prompt, prompt], [SamplingParams(max_tokens=4, temperature=t) for t in (0.0, 1e-40)])
    assert tiny.output_token_ids == greedy.output_token_ids
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
