"""The engine's step accounting: steps, tokens computed, wall and CPU time in steps."""

import time

from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
NAP_S = 0.02


def test_steps_count_every_token_the_model_computed(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32)
    before = engine.stats()
    assert (before.num_steps, before.num_step_tokens, before.step_s) == (0, 0, 0.0)
    prompts = random_prompts([5, 40], seed=3)
    engine.generate(prompts, PARAMS)
    stats = engine.stats()
    # Each prompt token once, then one decode token per output token but the last (never fed back).
    assert stats.num_step_tokens == sum(map(len, prompts)) + 2 * (PARAMS.max_tokens - 1)
    # 45 prompt tokens at 32 a step take two steps, the decodes of the longer request four more.
    assert 2 + (PARAMS.max_tokens - 1) <= stats.num_steps <= stats.num_step_tokens
    # A thread's CPU time lies within the wall time it ran (up to NTP's slewing of the monotonic clock, <= 0.05%).
    assert 0 < stats.step_cpu_s <= stats.step_s * 1.001


def test_time_a_step_spends_off_the_cpu_shows_as_its_stall(tiny_llama_dir):
    """What the stall (step_s - step_cpu_s) is for: time the stepping thread spends inside a step
    without running (waiting for the GIL or a core; here, a sleep in every model call) is wall
    time without CPU time. A sleep lasts at least its length, so the stall has a floor."""
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=256)
    execute, calls = engine.runner.execute, []

    def execute_after_a_nap(chunks, bitmasks=None):
        calls.append(len(chunks))
        time.sleep(NAP_S)
        return execute(chunks, bitmasks)

    engine.runner.execute = execute_after_a_nap
    s0 = engine.stats()
    engine.generate(random_prompts([24] * 4, seed=4), PARAMS)
    s1 = engine.stats()
    wall, cpu = s1.step_s - s0.step_s, s1.step_cpu_s - s0.step_cpu_s
    assert len(calls) == s1.num_steps - s0.num_steps == PARAMS.max_tokens
    assert 0 < cpu <= wall
    assert wall - cpu >= len(calls) * NAP_S


def test_each_request_traces_the_steps_and_batch_tokens_up_to_its_first_token(tiny_llama_dir):
    """A 40-token prompt at 32 tokens a step is prefilled in two steps (32, then 8); a 5-token
    prompt joining while it decodes takes one step, which also computes the other's decode token.
    The steps after the first token (decodes) are not counted."""
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32)
    long_prompt, short_prompt = random_prompts([40, 5], seed=5)
    engine.add_request("long", long_prompt, PARAMS)
    last = {}
    for step in range(20):
        if step == 3:
            engine.add_request("short", short_prompt, PARAMS)
        for out in engine.step():
            if out.finished:
                last[out.request_id] = out
        if len(last) == 2:
            break
    long_trace, short_trace = last["long"].trace, last["short"].trace
    assert (long_trace.prefill_steps, long_trace.prefill_step_tokens) == (2, 40)
    assert (short_trace.prefill_steps, short_trace.prefill_step_tokens) == (1, 5 + 1)
    assert long_trace.first_scheduled_s < long_trace.first_token_s < short_trace.admitted_s < short_trace.first_scheduled_s < short_trace.first_token_s
