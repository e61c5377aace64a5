"""The decode worker's end of the request plane: routers' Generate traffic over TCP, not Ray.

One connection per (router, decode worker), served on the actor's event loop::

    router                                          RequestPlaneServer
    connect; OpenChannel(channel_id, token) ──────> refuses a wrong token (it was handed out over Ray)
    Submit(request, prefill_replica_id) ──────────> starts the request; its events join the channel
    <── WorkerEventBatch: every event since the last batch, of every request on the channel
    Cancel(request_id) ───────────────────────────> the caller left: abort, free its blocks
    the connection closes (router gone) ──────────> every request still running on it is cancelled

With a ClusterTLSConfig the connection is mutual TLS first (proto/tls.py): a peer without a
certificate from the cluster CA, or one that speaks plain TCP, is refused before the token.

Ray stays the control plane. On the request path a Ray call costs two thread hand-offs per
process (its core worker's threads, then the actor's event loop) and a socket write costs none:
a request's submit and its tokens used to spend 4.3 ms in Ray on an idle cluster (bench/README.md).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from proto import worker_pb2 as wpb
from proto.framing import FrameTooLarge, read_frame, write_frame
from proto.tls import ClusterTLSConfig, server_context

logger = logging.getLogger(__name__)

_MAX_OPEN_BYTES = 4096
"""Before the token is checked, a peer may send no more than an OpenChannel needs."""

StartRequest = Callable[[wpb.Submit], AsyncIterator[wpb.WorkerEvent]]
"""Runs one submitted request: its events, the last one finishing it (or an error)."""


@dataclass
class RequestPlaneStats:
    """Counters of one worker's request plane."""

    num_channels_opened: int = 0
    num_channels_refused: int = 0
    """Connections closed before their channel opened: a failed TLS handshake, a wrong token or not an OpenChannel first."""
    num_open_channels: int = 0
    num_submitted: int = 0
    num_cancelled: int = 0
    """Requests stopped by a Cancel or by their channel closing."""


class RequestPlaneServer:
    """Serves channels on one TCP port; every request runs as ``start_request`` says. With
    ``tls``, a connection must complete a mutual TLS handshake before it may open a channel."""

    def __init__(
        self, replica_id: str, token: bytes, start_request: StartRequest, open_timeout_s: float = 10.0, tls: ClusterTLSConfig | None = None
    ) -> None:
        self.replica_id = replica_id
        self._token = token
        self._open_timeout_s = open_timeout_s
        """How long a new connection has for its TLS handshake, then as long for its OpenChannel."""
        self._ssl = server_context(tls) if tls is not None else None
        self._start_request = start_request
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.stats = RequestPlaneStats()

    async def start(self, host: str, port: int) -> wpb.RequestPlaneEndpoint:
        """Listen on ``host:port`` (port 0: any free one) and return where routers connect."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound_port = self._server.sockets[0].getsockname()[1]
        return wpb.RequestPlaneEndpoint(host=host, port=bound_port, token=self._token)

    def close(self) -> None:
        """Stop listening and drop every channel (their requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()  # its reader then ends, which cancels the channel's requests

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        try:
            if self._ssl is not None and not await self._handshake(writer, peer):
                return
            channel_id = await self._open(reader, peer)
            if channel_id is not None:
                await _Channel(self, channel_id, writer).run(reader)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _handshake(self, writer: asyncio.StreamWriter, peer) -> bool:
        """Whether the peer completed mutual TLS (else it is refused and logged). Runs before
        anything else awaits, so no byte of the peer's hello is read as plain TCP."""
        try:
            await writer.start_tls(self._ssl, ssl_handshake_timeout=self._open_timeout_s)
            return True
        except ssl.SSLError as e:
            reason = f"TLS handshake failed: {e}"
        except (OSError, TimeoutError) as e:  # one that never completes ends in ConnectionAbortedError
            reason = f"no TLS handshake: {e!r}"
        self._refuse(peer, reason)
        return False

    def _refuse(self, peer, reason: str) -> None:
        self.stats.num_channels_refused += 1
        logger.warning("replica %s: request plane refused a connection from %s: %s", self.replica_id, peer, reason)

    async def _open(self, reader: asyncio.StreamReader, peer) -> str | None:
        """The channel id of a connection that opened properly, else None (and logged)."""
        try:
            first = await asyncio.wait_for(read_frame(reader, _MAX_OPEN_BYTES), self._open_timeout_s)
            message = wpb.RouterMessage.FromString(first)
        except asyncio.TimeoutError:
            reason = f"no OpenChannel within {self._open_timeout_s} s"
        except (asyncio.IncompleteReadError, ConnectionError, FrameTooLarge, DecodeError) as e:
            reason = f"no OpenChannel ({e!r})"
        else:
            if message.WhichOneof("kind") != "open":
                reason = f"first message is {message.WhichOneof('kind')!r}, not 'open'"
            elif not hmac.compare_digest(message.open.token, self._token):
                reason = f"channel {message.open.channel_id!r} presented a wrong token"
            else:
                self.stats.num_channels_opened += 1
                return message.open.channel_id
        self._refuse(peer, reason)
        return None


class _Channel:
    """One router's open connection: its requests' tasks and the events waiting to be sent."""

    def __init__(self, server: RequestPlaneServer, channel_id: str, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.channel_id = channel_id
        self.writer = writer
        self.events: asyncio.Queue[wpb.WorkerEvent] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task] = {}

    async def run(self, reader: asyncio.StreamReader) -> None:
        stats = self.server.stats
        stats.num_open_channels += 1
        sender = asyncio.get_running_loop().create_task(self._send())
        try:
            await self._receive(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router closed the channel or went away
        except (FrameTooLarge, DecodeError, ValueError) as e:
            logger.warning("replica %s: channel %s broke the protocol, closing it: %s", self.server.replica_id, self.channel_id, e)
        finally:
            stats.num_open_channels -= 1
            sender.cancel()
            for task in list(self.tasks.values()):
                stats.num_cancelled += 1
                task.cancel()

    async def _receive(self, reader: asyncio.StreamReader) -> None:
        while True:
            data = await read_frame(reader)
            received_s = time.monotonic()
            message = wpb.RouterMessage.FromString(data)
            kind = message.WhichOneof("kind")
            if kind == "submit":
                self._submit(message.submit, received_s)
            elif kind == "cancel":
                task = self.tasks.get(message.cancel.request_id)
                if task is not None:
                    self.server.stats.num_cancelled += 1
                    task.cancel()
            else:
                raise ValueError(f"unexpected message {kind!r} on an open channel")

    def _submit(self, submit: wpb.Submit, received_s: float) -> None:
        request_id = submit.request.request_id
        if not request_id or request_id in self.tasks:
            problem = "is missing" if not request_id else f"{request_id!r} is already running on this channel"
            error = wpb.RequestError(code=wpb.RequestError.INVALID_ARGUMENT, message=f"request_id: {problem}")
            self.events.put_nowait(wpb.WorkerEvent(error=error, request_id=request_id))
            return
        self.server.stats.num_submitted += 1
        task = asyncio.get_running_loop().create_task(self._pump(submit, received_s))
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    async def _pump(self, submit: wpb.Submit, received_s: float) -> None:
        """Runs the request; its last response also reports how long it took from its Submit
        frame being read to starting (``Timings.request_plane_s``: this event loop's backlog)."""
        request_id = submit.request.request_id
        started_s = time.monotonic()
        try:
            async for event in self.server._start_request(submit):
                event.request_id = request_id
                if event.WhichOneof("kind") == "response" and event.response.finish_reason:
                    event.response.timings.request_plane_s = started_s - received_s
                self.events.put_nowait(event)
        except Exception as e:  # a bug must end its request with an error, never leave the caller waiting
            logger.exception("replica %s: request %s failed", self.server.replica_id, request_id)
            error = wpb.RequestError(code=wpb.RequestError.INTERNAL, message=f"replica {self.server.replica_id}: {e!r}")
            self.events.put_nowait(wpb.WorkerEvent(error=error, request_id=request_id))

    async def _send(self) -> None:
        """One frame per wake-up: the requests that produced in one engine step were all resumed
        before this task, so their events leave together."""
        while True:
            events = [await self.events.get()]
            while not self.events.empty():
                events.append(self.events.get_nowait())
            write_frame(self.writer, wpb.WorkerEventBatch(events=events))
            try:
                await self.writer.drain()
            except ConnectionError:
                return  # the receiving side sees the connection end and cancels the requests
