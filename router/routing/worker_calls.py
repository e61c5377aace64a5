"""The router's calls into workers. Awaited, never ``ray.get``: the event loop must not block.

Generate traffic runs on the request plane, one TCP *channel* per (router, decode worker); Ray
carries only the control calls (where the channel listens, the tokenizer's files, status)::

    router                                               decode worker
    WorkerChannel ──request_plane() (Ray, once)────────>  RequestPlaneEndpoint(host, port, token)
                  ══connect; OpenChannel(token)════════>  decode_worker/request_plane.py
                  ══Submit(request, prefill id)════════>  starts the request; its events join the channel
                  <══batch: events of every request that produced something since the last batch
                  ══Cancel(request_id)═════════════════>  the caller left: abort, free its blocks

so a decode step's tokens for all of this router's requests cross as one frame, and neither a
submit nor a token waits on Ray's threads. A connection that ends (the worker died, or closed
it) fails the requests on it with WorkerDied. With a ClusterTLSConfig the connection is mutual
TLS (proto/tls.py): the router presents the cluster certificate and checks the worker's.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from ray.exceptions import ActorUnavailableError, RayActorError

from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb
from proto.framing import FrameTooLarge, frame, read_frame
from proto.tls import ClusterTLSConfig, client_context

logger = logging.getLogger(__name__)

_DEAD = (RayActorError, ActorUnavailableError)
_TLS_HANDSHAKE_TIMEOUT_S = 10.0
_CLOSED = object()


class WorkerDied(Exception):
    """The worker actor went away (crashed, killed, unreachable) during the call."""


class _RouterClosed(WorkerDied):
    """The router closed the channel itself (the replica left the map, or the router stops)."""


class RequestIdInUse(Exception):
    """A request with this id is already running on the channel."""


class WorkerChannel:
    """This router's channel to one decode worker; ``generate`` streams one request over it."""

    def __init__(self, handle, channel_id: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handle = handle
        self.channel_id = channel_id
        self._ssl = ssl_context
        """Mutual TLS for the connection (proto.tls.client_context); None: plain TCP."""
        self.closed = False
        self.num_batches = 0
        """Frames of events received: one per batch."""
        self.num_events = 0
        self._error: WorkerDied | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opened = asyncio.Event()
        """Set once the channel is open or has failed to open (then ``closed`` is set too)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, request: pb.GenerateRequest, prefill_replica_id: str = "", resume_token_ids: Sequence[int] = ()) -> AsyncIterator[wpb.WorkerEvent]:
        """The worker's events for ``request`` (which must carry a request id), its prompt
        prefilled by prefill replica ``prefill_replica_id`` or by the decode worker itself;
        ``resume_token_ids``: the output a dead replica already streamed (a migrated request).
        Leaving early cancels the request on the worker, which aborts it and frees its blocks.
        Raises RequestIdInUse before sending anything if the id is running on this channel."""
        request_id = request.request_id
        if request_id in self._queues:
            raise RequestIdInUse(f"request_id: {request_id!r} is already in flight on decode worker channel {self.channel_id}")
        events: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = events
        finished = sent = False
        try:
            await self._opened.wait()
            if self.closed:
                raise self._error
            submit = wpb.Submit(request=request, prefill_replica_id=prefill_replica_id, resume_token_ids=resume_token_ids)
            self._writer.write(frame(wpb.RouterMessage(submit=submit)))
            sent = True
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
            if sent and not finished and not self.closed:
                self._writer.write(frame(wpb.RouterMessage(cancel=wpb.Cancel(request_id=request_id))))

    async def _run(self) -> None:
        try:
            endpoint = await self.handle.request_plane.remote()
            if self._ssl is None:
                reader, self._writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            else:
                reader, self._writer = await asyncio.open_connection(
                    endpoint.host, endpoint.port, ssl=self._ssl, ssl_handshake_timeout=_TLS_HANDSHAKE_TIMEOUT_S
                )
            self._writer.write(frame(wpb.RouterMessage(open=wpb.OpenChannel(channel_id=self.channel_id, token=endpoint.token))))
            self._opened.set()
            while True:
                batch = wpb.WorkerEventBatch.FromString(await read_frame(reader))
                self.num_batches += 1
                self.num_events += len(batch.events)
                for event in batch.events:
                    events = self._queues.get(event.request_id)
                    if events is not None:  # else: its caller already left
                        events.put_nowait(event)
        except asyncio.IncompleteReadError:
            self._error = WorkerDied(f"channel {self.channel_id}: the worker closed the connection")
        except _DEAD as e:
            self._error = WorkerDied(f"channel {self.channel_id}: {str(e).splitlines()[0]}")
        except OSError as e:
            self._error = WorkerDied(f"channel {self.channel_id}: {e}")
        except asyncio.CancelledError:
            self._error = _RouterClosed(f"channel {self.channel_id} was closed by the router")
            raise
        except (FrameTooLarge, DecodeError) as e:
            self._error = WorkerDied(f"channel {self.channel_id}: the worker broke the protocol: {e}")
        except Exception as e:  # a broken channel fails its requests, never the router
            self._error = WorkerDied(f"channel {self.channel_id} failed: {e!r}")
        finally:
            if not isinstance(self._error, _RouterClosed):
                logger.warning("request plane: %s", self._error)
            self.closed = True
            self._opened.set()
            if self._writer is not None:
                self._writer.close()
            for events in self._queues.values():
                events.put_nowait(_CLOSED)

    def close(self) -> None:
        """Close the connection; the worker then cancels every request still running on it."""
        if not self.closed:
            self._task.cancel()


@dataclass(frozen=True)
class ChannelStats:
    num_batches: int
    """Stream items received over every channel this router opened."""
    num_events: int
    """Events they carried."""


class WorkerChannels:
    """One open channel per decode replica, reopened when one breaks."""

    def __init__(self, router_id: str, tls: ClusterTLSConfig | None = None) -> None:
        self.router_id = router_id
        self._ssl = client_context(tls) if tls is not None else None
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
            channel = WorkerChannel(handle, f"{self.router_id}-{replica_id}-{uuid.uuid4().hex[:8]}", self._ssl)
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


async def tokenizer_files(handle) -> dict[str, bytes]:
    """A decode worker's tokenizer files by name (decode_worker.actor.DecodeWorker.tokenizer_files)."""
    try:
        return await handle.tokenizer_files.remote()
    except _DEAD as e:
        raise WorkerDied(str(e).splitlines()[0]) from e
