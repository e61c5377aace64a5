"""The decode worker's end of KV hand-offs: its NIXL agent, its endpoint, and waiting for writes.

NIXL runs without a progress thread (one would spin half a core per agent), so a write into this
pool only completes while this side also drives the agent. ``KVReceiver`` does that from the
event loop, polling every ``poll_interval_s`` while at least one hand-off is awaited and not at
all otherwise; a notification that arrives completes the future of whoever waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from kv_transfer.errors import KVTransferError
from kv_transfer.protocol import KVEndpoint, parse_notif, request_id_of

logger = logging.getLogger(__name__)

_MAX_EARLY = 1024


class KVReceiver:
    """Polls ``transport`` for hand-off notifications while someone awaits one."""

    def __init__(self, transport, endpoint: KVEndpoint, poll_interval_s: float = 0.0005) -> None:
        self.transport = transport
        self.endpoint = endpoint
        """What this worker publishes once, through the controller."""
        self.request_endpoint = replace(endpoint, transport_metadata=b"")
        """What each TransferRequest carries: the same, without the transport metadata."""
        self.poll_interval_s = poll_interval_s
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._writers: dict[bytes, set[int]] = {}
        """Writer ranks heard from so far, per awaited hand-off."""
        self._early: dict[bytes, tuple[str, set[int], int]] = {}
        """Notifications of hand-offs not awaited yet (a rank of a TP replica is asked to wait by
        its leader, which may reach it after a fast writer did); the oldest go beyond _MAX_EARLY."""
        self._poller: asyncio.Task | None = None
        self.num_stray_notifs = 0
        """Notifications nobody waited for (a hand-off given up before its write landed)."""

    def expect(self, notif: bytes) -> asyncio.Future:
        """A future that completes with the last sender's agent name once every writer of the
        hand-off ``notif`` (TransferRequest.notif) has sent its notification (``writer_notif``)."""
        if notif in self._waiting:
            raise KVTransferError(f"notification {notif!r} is already awaited")
        future = asyncio.get_running_loop().create_future()
        self._waiting[notif] = future
        self._writers[notif] = set()
        early = self._early.pop(notif, None)
        if early is not None:
            sender, writers, num_writers = early
            self._writers[notif] = writers
            self._complete_if_all(notif, sender, num_writers)
            if future.done():
                return future
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return future

    def forget(self, notif: bytes) -> None:
        """Stop waiting for ``notif`` (its hand-off ended another way)."""
        future = self._waiting.pop(notif, None)
        self._writers.pop(notif, None)
        if future is not None and not future.done():
            future.cancel()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def _poll(self) -> None:
        while self._waiting:
            try:
                arrived = self.transport.pop_notifs()
            except KVTransferError as e:  # the transport is closed or broken: fail every waiter
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(e)
                self._waiting.clear()
                self._writers.clear()
                return
            for sender, notifs in arrived.items():
                for notif in notifs:
                    self._arrived(sender, notif)
            await asyncio.sleep(self.poll_interval_s)

    def _arrived(self, sender: str, notif: bytes) -> None:
        try:
            base, writer, num_writers = parse_notif(notif)
        except KVTransferError:
            base, writer, num_writers = notif, 0, 1
        writers = self._writers.get(base)
        if writers is None:
            self.num_stray_notifs += 1
            logger.info("KV notification for %s from %s arrived while nobody awaited it", _describe(notif), sender)
            self._early.setdefault(base, (sender, set(), num_writers))[1].add(writer)
            while len(self._early) > _MAX_EARLY:
                del self._early[next(iter(self._early))]
            return
        writers.add(writer)
        self._complete_if_all(base, sender, num_writers)

    def _complete_if_all(self, base: bytes, sender: str, num_writers: int) -> None:
        if len(self._writers[base]) < num_writers:
            return
        future = self._waiting.pop(base)
        del self._writers[base]
        if not future.done():
            future.set_result(sender)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for notif in list(self._waiting):
            self.forget(notif)
        self.transport.close()


def _describe(notif: bytes) -> str:
    try:
        return f"request {request_id_of(notif)!r}"
    except KVTransferError:
        return repr(notif[:64])
