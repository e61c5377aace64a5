"""An answer's progress as the router streams it, and the n samples of one request.

A request for n samples runs as n answers of one sample each, interleaved on one call, each
response carrying its sample's ``index``::

    sample 0   ─ routed as any request (prefill replica P, decode replica D) ─► t t t ...
                        │ first token out: the prompt's full blocks are in D's prefix cache
    sample 1.. ─ on D, prefilled there: the full blocks are shared (one reference each), only
                 the prompt's last block is computed again, then each samples with its own seed
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from proto import splitserve_pb2 as pb
from router.frontend.validation import ResumeTagger, sample_seed


@dataclass
class AnswerStream:
    """One answer's progress across the decode replicas that served it (a call has one per sample)."""

    start_s: float
    """``time.perf_counter`` when the call started."""
    token_ids: list[int] = field(default_factory=list)
    """Token ids streamed to the client so far: a migrated call resumes after them."""
    num_migrations: int = 0
    ttft_s: float = 0.0
    last_s: float | None = None
    """When the last event reached the router; None before the first."""
    died_s: float | None = None
    """When the replica serving it was found dead, until another one answers."""
    tagger: ResumeTagger | None = None
    """Tags each response with the tokens streamed up to it (what a resume sends back)."""
    client_request_id: str = ""
    """The id the client's responses carry, when the workers know the call by another (a resume)."""
    seed: int | None = None
    """The seed reported in the first response (a sampled answer)."""
    on_first_response: Callable[[str], object] | None = None
    """Called with the decode replica's id when the first response arrives (sample 0 of n)."""
    counts_prompt: bool = True
    """Its prompt counts in the prompt metrics (not for samples 1.. of n: they share sample 0's)."""


async def generate_samples(generate_one: Callable[..., AsyncIterator[pb.GenerateResponse]], forwarded: pb.GenerateRequest, num_samples: int, start: float) -> AsyncIterator[pb.GenerateResponse]:
    """n samples of one prompt, as n answers (``generate_one(request, resume, stream, pinned)``
    streams one): sample i seeds with ``sample_seed(seed, i)``
    and its responses carry ``index`` i. Sample 0 is routed as any request; the others start
    once its first token is out, on the decode replica that serves it, prefilled there: the
    prompt's full blocks are then in that replica's prefix cache, so they share them (one
    reference each) and compute only the prompt's last block. Each sample migrates alone when
    its replica dies, and is resumed alone (as an answer of n = 1 with its reported seed)."""
    queue: asyncio.Queue = asyncio.Queue()
    first_served = asyncio.get_running_loop().create_future()
    streams = [AnswerStream(start, counts_prompt=i == 0) for i in range(num_samples)]
    streams[0].on_first_response = lambda replica_id: first_served.done() or first_served.set_result(replica_id)

    async def run(index: int) -> None:
        sample = pb.GenerateRequest()
        sample.CopyFrom(forwarded)
        sample.request_id = f"{forwarded.request_id}.{index}"
        if index and sample.sampling.HasField("seed"):
            sample.sampling.seed = sample_seed(forwarded.sampling.seed, index)
        pinned = None
        if index:
            pinned = await asyncio.shield(first_served)
        try:
            async with contextlib.aclosing(generate_one(sample, pb.Resume(), streams[index], pinned)) as responses:
                async for response in responses:
                    response.index = index
                    response.request_id = forwarded.request_id
                    await queue.put(response)
        except BaseException as e:
            if not first_served.done():
                first_served.set_exception(e) if isinstance(e, Exception) else first_served.cancel()
            await queue.put(e)
            return
        if not first_served.done():
            first_served.set_result(None)
        await queue.put(None)

    tasks = [asyncio.ensure_future(run(i)) for i in range(num_samples)]
    try:
        num_done = 0
        while num_done < num_samples:
            item = await queue.get()
            if item is None:
                num_done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
