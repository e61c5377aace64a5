"""NIXL transport: one agent (UCX backend) per worker over its whole KV pool, one WRITE per hand-off.

The pool (``uint8 [num_blocks, block_bytes]``) is registered once, when the transport is built:
as DRAM on the CPU, as VRAM of its GPU on CUDA (``nixl_memory``; UCX then moves it with its CUDA
transports). A peer learns everything it needs from ``metadata()``, its pool's memory type
included, so the two ends of a write may differ; a writer turns block ids into one
NIXL transfer whose descriptor list holds as few contiguous segments as possible
(kv_transfer.segments), and the transfer's notification tells the receiver it has landed.

NIXL is imported when a transport is built, never when this module is.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import torch

from kv_transfer.errors import KVTransferError, TransferTimeout
from kv_transfer.protocol import TransferState
from kv_transfer.segments import plan_segments

logger = logging.getLogger(__name__)

_MAGIC = b"SSNIXL"
_FORMAT_VERSION = 2
_HEADER = struct.Struct("<6sHHIQQQBI")
"""magic, format version, agent name length, NIXL metadata length, pool address, block_bytes,
num_blocks, memory type (index in _MEM_TYPES), device id."""
_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class NixlMemory:
    """Where a pool lives, as NIXL names it in registrations and transfer descriptors."""

    mem_type: str
    """``DRAM`` (host memory) or ``VRAM`` (a GPU's)."""
    device_id: int
    """The GPU's index for VRAM; 0 for DRAM."""


def nixl_memory(device: torch.device) -> NixlMemory:
    """The NIXL memory of a pool tensor on ``device``: DRAM on the CPU, VRAM of GPU N on ``cuda:N``."""
    if device.type == "cpu":
        return NixlMemory("DRAM", 0)
    if device.type == "cuda" and device.index is not None:
        return NixlMemory("VRAM", device.index)
    raise ValueError(f"device: {device} is not cpu or cuda:N, where a pool NIXL can register lives")


@dataclass(frozen=True)
class PeerPool:
    """A worker's registered pool as its transport metadata describes it."""

    agent_name: str
    base_address: int
    block_bytes: int
    num_blocks: int
    nixl_metadata: bytes
    mem_type: str = "DRAM"
    """NIXL's memory type of the pool: the type of the far side of a write's descriptors."""
    device_id: int = 0

    def encode(self) -> bytes:
        name = self.agent_name.encode()
        sizes = (len(name), len(self.nixl_metadata), self.base_address, self.block_bytes, self.num_blocks)
        header = _HEADER.pack(_MAGIC, _FORMAT_VERSION, *sizes, _MEM_TYPES.index(self.mem_type), self.device_id)
        return header + name + self.nixl_metadata

    @classmethod
    def decode(cls, data: bytes) -> PeerPool:
        """Parse NixlTransport.metadata(); KVTransferError when ``data`` is not such metadata."""
        if len(data) < _HEADER.size or not data.startswith(_MAGIC):
            raise KVTransferError(f"peer metadata: not NixlTransport metadata ({len(data)} bytes, starts {data[:8]!r})")
        magic, version, name_len, nixl_len, base, block_bytes, num_blocks, mem_code, device_id = _HEADER.unpack_from(data)
        if version != _FORMAT_VERSION:
            raise KVTransferError(f"peer metadata: format version {version}, this transport reads {_FORMAT_VERSION}")
        if len(data) != _HEADER.size + name_len + nixl_len or nixl_len == 0:
            raise KVTransferError(f"peer metadata: {len(data)} bytes, header announces {_HEADER.size + name_len + nixl_len}")
        if mem_code >= len(_MEM_TYPES):
            raise KVTransferError(f"peer metadata: memory type {mem_code} is none of {_MEM_TYPES}")
        try:
            name = data[_HEADER.size : _HEADER.size + name_len].decode()
        except UnicodeDecodeError as e:
            raise KVTransferError(f"peer metadata: agent name is not UTF-8: {e}") from e
        return cls(name, base, block_bytes, num_blocks, bytes(data[_HEADER.size + name_len :]), _MEM_TYPES[mem_code], device_id)


class NixlTransport:
    """One NIXL agent over one worker's KV pool. Thread-safe: every NIXL call holds one lock.

    ``pool`` is the worker's whole pool, ``uint8 [num_blocks, block_bytes]``, contiguous, on the
    CPU or a GPU (PagedKVCache.buffer); it must outlive the transport.

    Progress: without ``progress_thread`` (the default), NIXL moves only inside calls into it, so
    a write completes only while the writer polls its handle *and* the receiver calls progress(),
    pop_notifs() or wait_notif(), as a decode worker that waits for its KV does anyway. With
    ``progress_thread``, a UCX thread completes writes on its own but spins: about half a core
    per agent, idle or not, which on a 2-core machine cut loopback writes from 8.7 to 1.5 GB/s.
    """

    def __init__(self, agent_name: str, pool: torch.Tensor, *, progress_thread: bool = False) -> None:
        if not agent_name:
            raise KVTransferError("agent_name: must not be empty")
        if pool.device.type not in ("cpu", "cuda") or pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
            raise KVTransferError(
                f"pool: expected a contiguous CPU or CUDA uint8 [num_blocks, block_bytes] tensor, got {pool.dtype} "
                f"{list(pool.shape)} on {pool.device}{'' if pool.is_contiguous() else ', not contiguous'}"
            )
        if pool.numel() == 0:
            raise KVTransferError(f"pool: empty, shape {list(pool.shape)}")
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config

        self._nixl_errors = tuple(
            getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")
        )
        self.agent_name = agent_name
        self.num_blocks, self.block_bytes = pool.shape
        self._pool = pool
        self.memory = nixl_memory(pool.device)
        self._lock = threading.RLock()
        self._peers: dict[str, PeerPool] = {}
        self._open_handles: dict[int, TransferHandle] = {}
        self._notifs: dict[str, list[bytes]] = {}
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        try:
            self._agent = nixl_agent(agent_name, config)
            if "UCX" not in self._agent.backends:
                raise KVTransferError("NIXL found no UCX plugin")
            region = [(pool.data_ptr(), pool.numel(), self.memory.device_id, "")]
            self._registration = self._agent.register_memory(region, mem_type=self.memory.mem_type, backends=["UCX"])
            nixl_metadata = self._agent.get_agent_metadata()
            self._metadata = PeerPool(agent_name, pool.data_ptr(), self.block_bytes, self.num_blocks, nixl_metadata, *astuple(self.memory)).encode()
        except self._nixl_errors as e:
            raise KVTransferError(f"NIXL agent {agent_name!r}: set-up failed: {type(e).__name__}: {e}") from e
        self._closed = False

    def metadata(self) -> bytes:
        """What a peer passes to add_peer: agent metadata plus the pool's address and shape."""
        return self._metadata

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata so that writes can target its pool; returns its agent name.

        Idempotent for the same metadata; metadata that changed (a restarted peer) replaces the old.
        """
        pool = PeerPool.decode(metadata)
        if pool.agent_name == self.agent_name:
            raise KVTransferError(f"add_peer: {pool.agent_name!r} is this transport's own agent")
        with self._lock:
            self._check_open()
            if self._peers.get(pool.agent_name) == pool:
                return pool.agent_name
            if pool.agent_name in self._peers:
                self._forget_peer(pool.agent_name, reason="the peer's metadata was replaced")
            try:
                loaded = self._agent.add_remote_agent(pool.nixl_metadata)
            except self._nixl_errors as e:
                raise KVTransferError(f"add_peer {pool.agent_name!r}: NIXL rejected its metadata: {e}") from e
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != pool.agent_name:
                self._call(self._agent.remove_remote_agent, loaded)
                raise KVTransferError(f"add_peer: metadata names {pool.agent_name!r} but NIXL loaded {loaded!r}")
            self._peers[pool.agent_name] = pool
        return pool.agent_name

    def remove_peer(self, name: str) -> None:
        """Forget a peer; its open handles are released (in-flight writes aborted) first."""
        with self._lock:
            self._check_open()
            if name not in self._peers:
                raise KVTransferError(f"remove_peer: unknown peer {name!r}")
            self._forget_peer(name, reason=f"peer {name!r} was removed")

    def has_peer(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        byte_ranges: Sequence[range] | None = None,
        remote_byte_ranges: Sequence[range] | None = None,
    ) -> TransferHandle:
        """Post one NIXL WRITE of local blocks into ``peer``'s blocks; ``peer`` receives ``notif`` once it lands.

        Block ``local_block_ids[i]`` goes to ``remote_block_ids[i]``, whole or restricted to
        ``byte_ranges`` within each block (``remote_byte_ranges`` where the peer's block is laid
        out differently; see segments.head_slice_ranges). Runs of consecutive ids coalesce into
        single descriptors. With no blocks, only ``notif`` is sent. Invalid arguments raise
        KVTransferError before NIXL is touched. Release the returned handle when done with it.
        """
        if not isinstance(notif, bytes) or not notif:
            raise KVTransferError(f"notif: must be non-empty bytes, got {notif!r}")
        with self._lock:
            self._check_open()
            remote = self._peers.get(peer)
            if remote is None:
                raise KVTransferError(f"unknown peer {peer!r}: add_peer() its metadata first (known: {sorted(self._peers)})")
            segments = plan_segments(
                local_block_ids,
                remote_block_ids,
                local_num_blocks=self.num_blocks,
                local_block_bytes=self.block_bytes,
                remote_num_blocks=remote.num_blocks,
                remote_block_bytes=remote.block_bytes,
                byte_ranges=byte_ranges,
                remote_byte_ranges=remote_byte_ranges,
            )
            handle = self._post(remote, segments, notif)
            self._open_handles[id(handle)] = handle
        return handle

    def progress(self) -> None:
        """Let NIXL move writes into and out of this pool; notifications received are kept for pop_notifs."""
        with self._lock:
            self._check_open()
            self._drain_notifs()

    def pop_notifs(self) -> dict[str, list[bytes]]:
        """Every notification received since the last call, by sending peer, in arrival order."""
        with self._lock:
            self._check_open()
            self._drain_notifs()
            notifs, self._notifs = self._notifs, {}
        return notifs

    def wait_notif(self, notif: bytes, timeout_s: float, peer: str | None = None) -> str:
        """Wait for ``notif`` (from ``peer``, or anyone), consume it and return its sender.

        Other notifications stay queued for pop_notifs. Raises TransferTimeout after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            with self._lock:
                self._check_open()
                self._drain_notifs()
                for sender, messages in self._notifs.items():
                    if (peer is None or sender == peer) and notif in messages:
                        messages.remove(notif)
                        return sender
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"notification {notif!r} not received within {timeout_s} s")
            _pause(attempt)
            attempt += 1

    def num_open_handles(self) -> int:
        """Handles returned by write_blocks and not yet released."""
        with self._lock:
            return len(self._open_handles)

    def close(self) -> None:
        """Release every handle (aborting writes in flight), forget every peer, deregister the pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._open_handles.values()):
                self._release(handle, reason="the transport was closed", abandon=True)
            try:
                for name in list(self._peers):
                    self._agent.remove_remote_agent(name)
                self._agent.deregister_memory(self._registration, backends=["UCX"])
            except self._nixl_errors as e:
                logger.warning("closing NIXL agent %r: %s: %s", self.agent_name, type(e).__name__, e)
            self._peers.clear()
            self._agent = None

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers, {len(self._open_handles)} open handles"
        return f"NixlTransport({self.agent_name!r}, {self.num_blocks} x {self.block_bytes} B, {state})"

    # Everything below runs with self._lock held.

    def _post(self, remote: PeerPool, segments: np.ndarray, notif: bytes) -> TransferHandle:
        num_bytes = int(segments[:, 2].sum())
        if len(segments) == 0:
            self._call(self._agent.send_notif, remote.agent_name, notif)
            return TransferHandle(self, None, remote.agent_name, notif, 0, 0)
        sizes = segments[:, 2].astype(np.uint64)
        devices = np.full(len(segments), self.memory.device_id, dtype=np.uint64)
        local = np.stack([np.uint64(self._pool.data_ptr()) + segments[:, 0].astype(np.uint64), sizes, devices], axis=1)
        devices = np.full(len(segments), remote.device_id, dtype=np.uint64)
        far = np.stack([np.uint64(remote.base_address) + segments[:, 1].astype(np.uint64), sizes, devices], axis=1)
        xfer = self._call(
            self._agent.initialize_xfer,
            "WRITE",
            self._agent.get_xfer_descs(local, self.memory.mem_type),
            self._agent.get_xfer_descs(far, remote.mem_type),
            remote.agent_name,
            notif,
        )
        try:
            state = self._call(self._agent.transfer, xfer)
        except KVTransferError:
            xfer.release()
            raise
        if state == "ERR":
            xfer.release()
            raise KVTransferError(f"NIXL WRITE to {remote.agent_name!r} failed when posted (notif {notif!r})")
        handle = TransferHandle(self, xfer, remote.agent_name, notif, num_bytes, len(segments))
        handle._done = state == "DONE"
        return handle

    def _poll(self, handle: TransferHandle) -> TransferState:
        with self._lock:
            if handle._released_reason:
                raise KVTransferError(f"write to {handle.peer!r} (notif {handle.notif!r}): {handle._released_reason}")
            if not handle._done:
                state = self._call(self._agent.check_xfer_state, handle._xfer)
                if state == "ERR":
                    raise KVTransferError(f"NIXL WRITE to {handle.peer!r} failed (notif {handle.notif!r})")
                handle._done = state == "DONE"
            return TransferState.DONE if handle._done else TransferState.PROC

    def _release(self, handle: TransferHandle, reason: str, abandon: bool = False) -> None:
        with self._lock:
            if handle._released_reason:
                return
            if handle._xfer is not None:
                try:
                    handle._xfer.release()
                except self._nixl_errors as e:
                    if not abandon:
                        raise KVTransferError(f"cannot release the write to {handle.peer!r} yet: {e}") from e
                    logger.warning("abandoning the write to %r that NIXL could not abort: %s", handle.peer, e)
            handle._released_reason = reason
            del self._open_handles[id(handle)]

    def _forget_peer(self, name: str, reason: str) -> None:
        for handle in [h for h in self._open_handles.values() if h.peer == name]:
            self._release(handle, reason)
        del self._peers[name]
        self._call(self._agent.remove_remote_agent, name)

    def _drain_notifs(self) -> None:
        for sender, messages in self._call(self._agent.get_new_notifs).items():
            self._notifs.setdefault(sender, []).extend(messages)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._nixl_errors as e:
            raise KVTransferError(f"NIXL {fn.__name__} failed: {type(e).__name__}: {e}") from e

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"transport {self.agent_name!r} is closed")


class TransferHandle:
    """A write posted by NixlTransport.write_blocks. Poll or wait for it, then release it (or use ``with``)."""

    def __init__(
        self, transport: NixlTransport, xfer, peer: str, notif: bytes, num_bytes: int, num_descriptors: int
    ) -> None:
        self.peer = peer
        self.notif = notif
        self.num_bytes = num_bytes
        """Bytes the write copies."""
        self.num_descriptors = num_descriptors
        """Contiguous segments in its descriptor list, after coalescing."""
        self._transport = transport
        self._xfer = xfer
        self._done = xfer is None
        self._released_reason = ""

    def poll(self) -> TransferState:
        """DONE once every byte is in the peer's pool; KVTransferError if the write failed or was released."""
        return self._transport._poll(self)

    def wait(self, timeout_s: float) -> None:
        """Return once DONE; TransferTimeout after ``timeout_s`` (the write stays posted: release aborts it)."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while self.poll() is TransferState.PROC:
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"write to {self.peer!r} (notif {self.notif!r}) not done within {timeout_s} s")
            _pause(attempt)
            attempt += 1

    def release(self) -> None:
        """Free the NIXL request (idempotent); a write still in flight is aborted."""
        self._transport._release(self, reason="the handle was released")

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released_reason else ("done" if self._done else "posted")
        return f"TransferHandle(peer={self.peer!r}, {self.num_bytes} B in {self.num_descriptors} descriptors, {state})"


def _pause(attempt: int) -> None:
    """Yield the GIL for the first polls, then back off exponentially to 200 us."""
    time.sleep(0.0 if attempt < 32 else min(200e-6, 1e-6 * 2 ** (attempt - 32)))
