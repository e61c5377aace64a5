"""A "query of death": a request whose steps raise fails alone, with its error named; the others
finish with the tokens they would have had without it, its blocks come back, and the loop goes
on. A failure that no request explains still ends the loop (the replica is replaced).

The fault is a sampler that raises for the request seeded ``POISON_SEED`` from its
``POISON_AT``-th output token on, standing in for a sampler bug on an odd parameter (like the
top_k beyond the vocabulary that once killed the engine thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import engine.request
import engine.runner
from engine.engine_loop import EngineLoop
from engine.errors import EngineLoopFailed, RequestFailedError
from engine.params import SamplingParams
from engine.request import EngineRequest
from tests.unit.engine.helpers import make_engine, random_prompts

POISON_SEED = 666
POISON_AT = 3
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
POISON = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, seed=POISON_SEED)


def poisoned_sampler(monkeypatch, fail_everyone: bool = False, error: type[BaseException] = ValueError, at: int = POISON_AT) -> list[int]:
    """Make the runner's sampler raise for the poison request from its ``at``-th output token on
    (or for every batch); returns a list that records the size of every batch it was called with."""
    real = engine.runner.sample
    batch_sizes: list[int] = []

    def sample(logits, params, seeds, positions):
        batch_sizes.append(len(seeds))
        if fail_everyone or any(s == POISON_SEED and p >= at for s, p in zip(seeds, positions)):
            raise error("top_k out of range for this request")
        return real(logits, params, seeds, positions)

    monkeypatch.setattr(engine.runner, "sample", sample)
    return batch_sizes


async def collect(loop: EngineLoop, request_id: str, prompt, params=PARAMS):
    """The request's tokens, or the exception its stream ended with."""
    tokens = []
    try:
        async for out in loop.generate(EngineRequest(request_id, prompt, None, params, None)):
            tokens += out.new_token_ids
    except (RequestFailedError, EngineLoopFailed) as e:
        return e
    return tuple(tokens)


@pytest.fixture
def make_loop(tiny_llama_dir):
    loops = []

    def make() -> EngineLoop:
        loop = EngineLoop(lambda: make_engine(tiny_llama_dir, weights="fp32", max_num_seqs=8), max_waiting_requests=8, num_threads=1)
        loop.start()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        if loop.alive:
            loop.stop()


def test_a_poison_request_fails_alone_and_the_others_keep_their_tokens(tiny_llama_dir, make_loop, monkeypatch):
    prompts = random_prompts([5, 17, 9], seed=7)
    expected = [c.output_token_ids for c in make_engine(tiny_llama_dir, weights="fp32").generate(prompts, PARAMS)]
    batch_sizes = poisoned_sampler(monkeypatch)
    loop = make_loop()

    async def main():
        streams = [collect(loop, f"r{i}", p) for i, p in enumerate(prompts)]
        return await asyncio.gather(*streams[:2], collect(loop, "poison", [3, 4, 5, 6, 7], POISON), *streams[2:])

    *before, poisoned, after = asyncio.run(main())
    assert [*before, after] == expected
    assert isinstance(poisoned, RequestFailedError) and poisoned.request_id == "poison"
    assert str(poisoned) == (
        "request 'poison' failed: a step raised ValueError: top_k out of range for this request for this request alone; the other requests go on"
    )
    assert 1 in batch_sizes and max(batch_sizes) > 1  # it decoded beside others, then ran alone
    stats = loop.stats
    assert stats.num_failed_requests == 1 and stats.num_aborted_requests == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    # The loop goes on: the same poison fails again alone, a fresh request is served as before.
    again, fresh = asyncio.run(_two(collect(loop, "poison", [3, 4, 5, 6, 7], POISON), collect(loop, "fresh", prompts[0])))
    assert isinstance(again, RequestFailedError) and fresh == expected[0]
    assert loop.alive and loop.stats.num_free_kv_blocks == loop.stats.num_kv_blocks


async def _two(a, b):
    return await asyncio.gather(a, b)


def test_the_same_poison_sent_twice_at_once_and_retried_fails_each_time_and_the_loop_goes_on(tiny_llama_dir, make_loop, monkeypatch):
    """Requests of one input raise alike: two copies alone in a step, then a retry alone in the
    very next step, are one input's failures, not an engine's (whose failure needs two different
    inputs). The poison raises at its first token, so no step between them runs through."""
    prompt = random_prompts([6], seed=5)[0]
    [expected] = [c.output_token_ids for c in make_engine(tiny_llama_dir, weights="fp32").generate([prompt], PARAMS)]
    batch_sizes = poisoned_sampler(monkeypatch, at=0)
    loop = make_loop()
    release = threading.Event()

    async def copies():
        busy = asyncio.ensure_future(loop.call(lambda engine: release.wait(30)))  # holds the engine thread: both copies join its next step
        streams = asyncio.gather(*(collect(loop, f"poison-{i}", [3, 4, 5, 6, 7], POISON) for i in range(2)))
        for _ in range(3):
            await asyncio.sleep(0)
        release.set()
        await busy
        return await streams

    assert all(isinstance(r, RequestFailedError) for r in asyncio.run(copies()))
    assert batch_sizes == [2] + [1] * (len(batch_sizes) - 1)  # together, then each alone while isolating
    assert isinstance(asyncio.run(collect(loop, "poison-retry", [3, 4, 5, 6, 7], POISON)), RequestFailedError)
    assert loop.alive
    assert asyncio.run(collect(loop, "fresh", prompt)) == expected
    stats = loop.stats
    assert stats.num_failed_requests == 3 and stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread dies raising, as it should
@pytest.mark.parametrize("error", [ValueError, MemoryError], ids=["every-request-raises", "out-of-memory"])
def test_a_failure_no_request_explains_ends_the_loop_for_every_stream(make_loop, monkeypatch, error):
    poisoned_sampler(monkeypatch, fail_everyone=True, error=error)
    loop = make_loop()

    release = threading.Event()

    async def main():
        busy = asyncio.ensure_future(loop.call(lambda engine: release.wait(30)))  # holds the engine thread: both requests join its first step
        streams = asyncio.gather(*(collect(loop, f"r{i}", p) for i, p in enumerate(random_prompts([5, 9], seed=3))))
        for _ in range(3):
            await asyncio.sleep(0)  # each stream hands its request to the loop
        release.set()
        await busy
        return await streams

    results = asyncio.run(main())
    assert all(isinstance(r, EngineLoopFailed) for r in results), results
    assert "top_k out of range" in str(results[0]) and not loop.alive
    loop.stop()  # joins the dying thread, whose exception pytest reports within this test


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread dies raising, as it should
def test_two_different_lone_requests_failing_in_a_row_end_the_loop(make_loop, monkeypatch):
    poisoned_sampler(monkeypatch, fail_everyone=True)
    loop = make_loop()
    a, b = random_prompts([5, 9], seed=3)
    assert isinstance(asyncio.run(collect(loop, "r0", a)), RequestFailedError)  # alone, it may be the request's
    assert isinstance(asyncio.run(collect(loop, "r1", b)), EngineLoopFailed)  # a second input failing too is the engine's
    assert not loop.alive
    loop.stop()


def test_a_request_whose_update_raises_fails_alone(tiny_llama_dir, monkeypatch):
    """A fault after sampling (the request's stop check or detokenizer, standing in here for its
    ``append_token``) fails that request alone too; the others' updates of the step stand."""
    prompts = random_prompts([5, 17], seed=11)
    llm = make_engine(tiny_llama_dir, weights="fp32")
    expected = [c.output_token_ids for c in llm.generate(prompts, PARAMS)]
    real = engine.request.Request.append_token

    def append_token(request, token_id):
        if request.seed == POISON_SEED and request.num_output_tokens >= POISON_AT:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        real(request, token_id)

    monkeypatch.setattr(engine.request.Request, "append_token", append_token)
    for request_id, prompt, params in (("r0", prompts[0], PARAMS), ("poison", [3, 4, 5], POISON), ("r1", prompts[1], PARAMS)):
        llm.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {"r0": [], "poison": [], "r1": []}
    failures = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens[out.request_id] += out.new_token_ids
        failures += llm.take_failures()
    assert [tuple(tokens["r0"]), tuple(tokens["r1"])] == expected
    assert [(f.request_id, f.cause.split(":")[0]) for f in failures] == [("poison", "UnicodeDecodeError")]
    assert len(tokens["poison"]) == POISON_AT  # what it streamed before its update raised
    stats = llm.stats()
    assert stats.num_failed_requests == 1 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_failed_requests_are_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.outputs import EngineStats
    from engine.metrics import EngineStatsCollector

    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: EngineStats(0, 0, 8, 8, 0, 0, 0, 0, num_failed_requests=2), {"replica": "d0"}))
    assert 'splitserve_worker_requests_failed_total{replica="d0"} 2.0' in generate_latest(registry).decode()
