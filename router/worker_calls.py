"""The router's Ray calls into workers. Awaited, never ``ray.get``: the event loop must not block."""

from __future__ import annotations

from collections.abc import AsyncIterator

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb

_DEAD = (RayActorError, ActorUnavailableError)


class WorkerDied(Exception):
    """The worker actor went away (crashed, killed, unreachable) during the call."""


async def stream_generate(handle, request: pb.GenerateRequest, prefill=None, prefill_replica_id: str = "") -> AsyncIterator[wpb.WorkerEvent]:
    """The decode worker's event stream for ``request``, its prompt prefilled by the ``prefill``
    worker (a handle) or, with None, by the decode worker itself. Leaving the stream early
    cancels the worker's task, which aborts the request there and frees its blocks."""
    stream = handle.generate.options(num_returns="streaming").remote(request, prefill, prefill_replica_id)
    finished = False
    try:
        async for ref in stream:
            yield await ref
        finished = True
    except _DEAD as e:
        raise WorkerDied(str(e).splitlines()[0]) from e
    finally:
        if not finished:
            ray.cancel(stream)


async def tokenize(handle, request: pb.TokenizeRequest) -> wpb.TokenizeResult:
    try:
        return await handle.tokenize.remote(request)
    except _DEAD as e:
        raise WorkerDied(str(e).splitlines()[0]) from e
