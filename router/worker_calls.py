"""The router's Ray calls into workers. Awaited, never ``ray.get``: the event loop must not block.

Generate traffic runs over one *channel* per (router, decode worker)::

    router                                           decode worker
    WorkerChannel ──open_channel (streaming)──────>  one stream of WorkerEventBatches
                  ──submit(request, prefill) ─────>  starts the request; its events join the stream
                  <── batch: events of every request that produced something since the last batch
                  ──cancel(request_id) ───────────>  the caller left: abort, free its blocks

so a decode step's tokens for all of this router's requests cross Ray as one item instead of
one item per request (a Ray streaming item costs ~0.3 ms of CPU on each side).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb

_DEAD = (RayActorError, ActorUnavailableError)
_CLOSED = object()


class WorkerDied(Exception):
    """The worker actor went away (crashed, killed, unreachable) during the call."""


class WorkerChannel:
    """This router's channel to one decode worker; ``generate`` streams one request over it."""

    def __init__(self, handle, channel_id: str) -> None:
        self.handle = handle
        self.channel_id = channel_id
        self.closed = False
        self.num_batches = 0
        """Stream items received: one per batch of events."""
        self.num_events = 0
        self._error: WorkerDied | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stream = handle.open_channel.options(num_returns="streaming").remote(channel_id)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def generate(self, request: pb.GenerateRequest, prefill=None, prefill_replica_id: str = "") -> AsyncIterator[wpb.WorkerEvent]:
        """The worker's events for ``request`` (which must carry a request id), its prompt
        prefilled by the ``prefill`` worker (a handle) or by the decode worker itself. Leaving
        early cancels the request on the worker, which aborts it and frees its blocks."""
        request_id = request.request_id
        events: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = events
        finished = False
        try:
            try:
                submitted = await self.handle.submit.remote(self.channel_id, request, prefill, prefill_replica_id)
            except _DEAD as e:
                raise WorkerDied(str(e).splitlines()[0]) from e
            if not submitted:
                raise WorkerDied(f"channel {self.channel_id} is not open on the worker")
            while True:
                event = await events.get()
                if event is _CLOSED:
                    raise self._error or WorkerDied(f"channel {self.channel_id} closed")
                finished = event.HasField("error") or event.response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield event
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self.closed:
                self.handle.cancel.remote(self.channel_id, request_id)  # fire and forget

    async def _read(self) -> None:
        try:
            async for ref in self._stream:
                batch = wpb.WorkerEventBatch.FromString(await ref)
                self.num_batches += 1
                self.num_events += len(batch.events)
                for event in batch.events:
                    events = self._queues.get(event.request_id)
                    if events is not None:  # else: its caller already left
                        events.put_nowait(event)
            self._error = WorkerDied(f"channel {self.channel_id} ended")
        except _DEAD as e:
            self._error = WorkerDied(str(e).splitlines()[0])
        except asyncio.CancelledError:
            self._error = WorkerDied(f"channel {self.channel_id} was closed by the router")
            raise
        except Exception as e:  # a broken stream fails its requests, never the router
            self._error = WorkerDied(f"channel {self.channel_id} failed: {e!r}")
        finally:
            self.closed = True
            for events in self._queues.values():
                events.put_nowait(_CLOSED)

    def close(self) -> None:
        """Close the stream; the worker then cancels every request still running on it."""
        if not self.closed:
            self._reader.cancel()
            ray.cancel(self._stream)


@dataclass(frozen=True)
class ChannelStats:
    num_batches: int
    """Stream items received over every channel this router opened."""
    num_events: int
    """Events they carried."""


class WorkerChannels:
    """One open channel per decode replica, reopened when one breaks."""

    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self._channels: dict[str, WorkerChannel] = {}
        self._retired = ChannelStats(0, 0)

    def stats(self) -> ChannelStats:
        channels = list(self._channels.values())
        return ChannelStats(
            self._retired.num_batches + sum(c.num_batches for c in channels),
            self._retired.num_events + sum(c.num_events for c in channels),
        )

    def get(self, replica_id: str, handle) -> WorkerChannel:
        """The open channel to ``replica_id`` (replica ids are never reused for another actor)."""
        channel = self._channels.get(replica_id)
        if channel is None or channel.closed:
            if channel is not None:
                self._retire(channel)
            channel = WorkerChannel(handle, f"{self.router_id}-{replica_id}-{uuid.uuid4().hex[:8]}")
            self._channels[replica_id] = channel
        return channel

    def retain(self, replica_ids) -> None:
        """Close the channels of replicas that left the map."""
        for replica_id in [r for r in self._channels if r not in replica_ids]:
            channel = self._channels.pop(replica_id)
            channel.close()
            self._retire(channel)

    def _retire(self, channel: WorkerChannel) -> None:
        self._retired = ChannelStats(self._retired.num_batches + channel.num_batches, self._retired.num_events + channel.num_events)

    def close(self) -> None:
        self.retain(())


async def tokenize(handle, request: pb.TokenizeRequest) -> wpb.TokenizeResult:
    try:
        return await handle.tokenize.remote(request)
    except _DEAD as e:
        raise WorkerDied(str(e).splitlines()[0]) from e
