"""A decode worker's lease on a hand-off's blocks ends however its call ends, here for a call
cancelled after its admission leased the blocks but before it could ask a prefill worker
(in-process worker, real NIXL agent)."""

import asyncio
import threading

from decode_worker.actor import DecodeWorker
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from router.client import build_generate_request


def test_a_call_cancelled_while_its_admission_is_queued_leaves_no_lease(tiny_llama_dir):
    worker = DecodeWorker("decode-t", EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=32), WorkerConfig())
    gate = threading.Event()

    async def scenario():
        busy = asyncio.ensure_future(worker.loop.call(lambda engine: gate.wait(30)))  # holds the engine thread
        request = build_generate_request(list(range(3, 70)), max_tokens=4, request_id="r")
        call = asyncio.ensure_future(anext(worker.generate(request, prefill=object(), prefill_replica_id="prefill-x")))
        for _ in range(20):
            await asyncio.sleep(0)  # the call reaches its admission, queued behind the busy engine thread
        admitted = threading.Event()
        after = asyncio.ensure_future(worker.loop.call(lambda engine: admitted.set()))  # queued after the admission
        for _ in range(20):
            await asyncio.sleep(0)
        gate.set()
        admitted.wait(30)  # blocks this event loop: the admission (a lease) is done, the call has not resumed yet
        call.cancel()
        await asyncio.gather(busy, after)
        assert call.cancelled()
        while worker._cleanups:
            await asyncio.gather(*worker._cleanups)
        return await worker.loop.call(lambda engine: engine.stats())

    try:
        stats = asyncio.run(scenario())
        assert (stats.num_leases, stats.num_parked, stats.num_free_kv_blocks) == (0, 0, stats.num_kv_blocks)
    finally:
        gate.set()
        asyncio.run(worker.shutdown())
