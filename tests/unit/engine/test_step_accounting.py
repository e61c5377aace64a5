"""The engine's step accounting: steps, tokens computed, wall and CPU time in steps."""

import sys
import threading

from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


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
    assert 0 < stats.step_cpu_s <= stats.step_s * 1.05


def test_a_thread_holding_the_gil_shows_as_step_time_off_the_cpu(tiny_llama_dir):
    """What the stall (step_s - step_cpu_s) is for: a busy Python thread beside the engine takes
    the GIL from it every switch interval, and those waits are wall time without CPU time."""
    prompts = random_prompts([24] * 8, seed=4)
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=256)

    def run() -> tuple[float, float]:
        s0 = engine.stats()
        engine.generate(prompts, PARAMS)
        s1 = engine.stats()
        steps = s1.num_steps - s0.num_steps
        wall, cpu = s1.step_s - s0.step_s, s1.step_cpu_s - s0.step_cpu_s
        return wall / steps, (wall - cpu) / steps

    run()  # warm
    _, alone = run()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(100))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        step, contended = run()
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    # Two threads that both want the GIL take turns: the engine's steps wait for a good part of their time.
    assert contended > 0.2 * step, (step, contended)
    assert alone < contended / 10, (alone, contended)
