"""EngineLoop: the engine on its own thread, driven from asyncio (no Ray involved)."""

import asyncio
import os
import threading
import time

import pytest

from engine.config import WorkerProcessConfig
from engine.engine_loop import EngineLoop
from engine.errors import AdmissionQueueFull, CheckpointError, InvalidRequestError
from engine.request import EngineRequest
from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _request(request_id, prompt, params=PARAMS):
    return EngineRequest(request_id, prompt, None, params, None)


@pytest.fixture
def loop(tiny_llama_dir):
    engine_loop = EngineLoop(lambda: make_engine(tiny_llama_dir, max_num_seqs=2), max_waiting_requests=2, num_threads=1)
    engine_loop.start()
    yield engine_loop
    engine_loop.stop()


async def _collect(loop, request):
    """The request's tokens, its last output, and when (time.monotonic) that reached this coroutine."""
    tokens = []
    async for out in loop.generate(request):
        tokens += out.new_token_ids
        last = out
    return tokens, last, time.monotonic()


def test_concurrent_streams_equal_the_engine_alone(loop, tiny_llama_dir):
    prompts = random_prompts([5, 17, 30], seed=31)
    expected = [c.output_token_ids for c in make_engine(tiny_llama_dir).generate(prompts, PARAMS)]

    async def main():
        return await asyncio.gather(*(_collect(loop, _request(f"r{i}", p)) for i, p in enumerate(prompts)))

    got = asyncio.run(main())
    assert [tuple(tokens) for tokens, _, _ in got] == expected
    assert all(last.finished for _, last, _ in got)
    assert loop.stats.num_free_kv_blocks == loop.stats.num_kv_blocks
    # Two batch slots: the third request waits for one of the first two to finish (12 steps)...
    queue_s = [last.queue_s for _, last, _ in got]
    assert max(queue_s[:2]) < queue_s[2]
    # ...and the trace puts that wait after admission (no free slot): it was taken in before a
    # slot freed, and scheduled only after both others had sampled their first token.
    first, second, third = (last.trace for _, last, _ in got)
    assert third.admitted_s < min(done_s for _, _, done_s in got[:2])
    assert third.first_scheduled_s > max(first.first_token_s, second.first_token_s)
    for t in (first, second, third):
        assert t.arrival_s <= t.admitted_s <= t.first_scheduled_s < t.first_token_s


def test_only_the_last_output_carries_the_queue_time(loop):
    async def main():
        return [out async for out in loop.generate(_request("q", [5, 6, 7]))]

    started = time.monotonic()
    outputs = asyncio.run(main())
    assert [o.queue_s is None for o in outputs] == [True] * (len(outputs) - 1) + [False]
    assert [o.trace is None for o in outputs] == [True] * (len(outputs) - 1) + [False]
    assert 0 < outputs[-1].queue_s < time.monotonic() - started


def test_queue_time_counts_the_wait_for_the_engine_thread(loop):
    """A request handed over while the engine thread is busy (here: a call that lasts until the
    test releases it, standing in for a long step) waits in the loop's inbox; its queue time
    includes the wait, and its trace places the wait before the engine thread took it in."""
    busy, release = threading.Event(), threading.Event()
    released_s = []

    def hold(engine):
        busy.set()
        release.wait()

    async def main():
        held = asyncio.ensure_future(loop.call(hold))
        await asyncio.to_thread(busy.wait)
        late = asyncio.ensure_future(_collect(loop, _request("late", [5, 6, 7])))
        await asyncio.sleep(0.1)  # the request is in the inbox
        released_s.append(time.monotonic())
        release.set()
        await held
        return await late

    _, last, _ = asyncio.run(main())
    t = last.trace
    assert t.arrival_s < released_s[0] <= t.admitted_s <= t.first_scheduled_s
    assert last.queue_s >= released_s[0] - t.arrival_s


def test_a_step_crosses_to_each_event_loop_once(loop):
    """All of a step's outputs for one event loop arrive in one callback, not one per stream."""

    async def main():
        running = asyncio.get_running_loop()
        crossings = []
        post = running.call_soon_threadsafe
        running.call_soon_threadsafe = lambda *args, **kw: (crossings.append(args[0]), post(*args, **kw))[1]
        got = await asyncio.gather(*(_collect(loop, _request(f"x{i}", [5, 6, 7])) for i in range(2)))
        return crossings, got

    steps_before = loop.stats.num_steps
    crossings, got = asyncio.run(main())
    num_steps = loop.stats.num_steps - steps_before
    assert sum(len(tokens) for tokens, _, _ in got) == 2 * PARAMS.max_tokens
    # At most one crossing per step plus the two admissions, however the two requests' steps
    # overlapped (one per output would be 24 + 2 whenever they shared steps).
    assert len(crossings) <= num_steps + 2


def test_invalid_request_fails_before_any_output_and_the_loop_goes_on(loop):
    async def main():
        with pytest.raises(InvalidRequestError, match="^prompt_token_ids: must not be empty"):
            await _collect(loop, _request("bad", []))
        return await _collect(loop, _request("good", [5, 6, 7]))

    tokens, last, _ = asyncio.run(main())
    assert len(tokens) == PARAMS.max_tokens and last.finished


def test_leaving_a_stream_early_aborts_the_request(loop):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        stream = loop.generate(_request("long", random_prompts([20])[0], long))
        await stream.__anext__()
        await stream.aclose()
        while loop.stats.num_aborted_requests == 0 or loop.stats.num_running:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    stats = loop.stats
    assert (stats.num_aborted_requests, stats.num_free_kv_blocks) == (1, stats.num_kv_blocks)


def test_full_admission_queue_is_refused(loop):
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        streams = [loop.generate(_request(f"r{i}", [5, 6, 7], long)) for i in range(5)]
        outcomes = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        for s in streams:
            await s.aclose()
        return outcomes

    outcomes = asyncio.run(main())
    refused = [o for o in outcomes if isinstance(o, AdmissionQueueFull)]
    assert len(refused) == 1  # 2 running slots + 2 waiting admitted, the fifth refused
    assert "requests already waiting" in str(refused[0])


def test_engine_that_cannot_be_built_fails_start(tmp_path):
    engine_loop = EngineLoop(lambda: make_engine(tmp_path), max_waiting_requests=1, num_threads=1)
    with pytest.raises(CheckpointError, match="config.json"):
        engine_loop.start()


def test_cancel_while_waiting_for_admission_still_aborts(loop):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(_collect(loop, _request("early", [5, 6, 7], long)))
        await asyncio.sleep(0)  # the add command is queued, admission not yet awaited through
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while loop.stats.num_running or loop.stats.num_waiting:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert loop.stats.num_free_kv_blocks == loop.stats.num_kv_blocks


def _nice_of_threads() -> dict[int, int]:
    """Each thread of this process and its nice value (field 19 of /proc/self/task/TID/stat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_the_engine_thread_and_its_openmp_team_run_at_the_given_nice(tiny_llama_dir):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine_loop = EngineLoop(lambda: make_engine(tiny_llama_dir), max_waiting_requests=2, num_threads=2, nice=3)
    engine_loop.start()
    try:
        asyncio.run(_collect(engine_loop, _request("n", random_prompts([40])[0])))  # a parallel op starts the OpenMP team
        nice = _nice_of_threads()
        assert nice[engine_loop._thread.native_id] == base + 3
        assert sum(v == base + 3 for v in nice.values()) >= 2  # the engine thread and its OpenMP worker
        assert nice[threading.get_native_id()] == base  # the caller's thread keeps its priority
    finally:
        engine_loop.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine_thread_nice": -1}, "engine_thread_nice: must be in"),
        ({"gil_switch_interval_s": 0}, "gil_switch_interval_s: must be in"),
    ],
)
def test_worker_process_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkerProcessConfig(**kwargs)


def test_a_call_runs_even_when_its_caller_is_cancelled_while_it_waits(loop):
    gate, ran = threading.Event(), []

    async def main():
        busy = asyncio.ensure_future(loop.call(lambda engine: gate.wait(30)))
        cleanup = asyncio.ensure_future(loop.call(lambda engine: ran.append("released")))  # e.g. a lease's release in a finally
        await asyncio.sleep(0)
        cleanup.cancel()  # the caller is cancelled while the engine thread is busy
        gate.set()
        await busy
        assert cleanup.cancelled()
        await loop.call(lambda engine: None)  # queued after the cleanup: once it returns, the cleanup has run

    asyncio.run(main())
    assert ran == ["released"]
