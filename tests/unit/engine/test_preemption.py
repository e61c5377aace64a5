"""A pool too small for every sequence preempts and recomputes without losing or changing output."""

from engine.params import SamplingParams
from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts, run_staggered

SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


def test_preemption_finishes_every_request_with_unchanged_tokens(tiny_llama_dir):
    prompts = random_prompts([30, 45, 20, 60, 38, 25])
    expected = run_staggered(make_engine(tiny_llama_dir, num_kv_blocks=256), prompts, GREEDY, every=1)

    small = make_engine(tiny_llama_dir, num_kv_blocks=12, max_num_batched_tokens=64)
    got = run_staggered(small, prompts, GREEDY, every=1)

    stats = small.stats()
    assert stats.num_preemptions > 0
    assert got == expected
    assert (stats.num_free_kv_blocks, stats.num_running, stats.num_waiting) == (12, 0, 0)


def test_preempted_seeded_sampling_continues_its_own_random_stream(tiny_llama_dir):
    prompts = random_prompts([30, 45, 20, 60, 38, 25], seed=9)
    expected = run_staggered(make_engine(tiny_llama_dir, num_kv_blocks=256), prompts, SEEDED, every=1)
    small = make_engine(tiny_llama_dir, num_kv_blocks=12, max_num_batched_tokens=64)
    got = run_staggered(small, prompts, SEEDED, every=1)
    assert small.stats().num_preemptions > 0
    assert got == expected
