"""NixlTransport between two real processes over UCX on loopback.

The test process is the writer (prefill side); a spawned process is the receiver (decode side)
and answers commands over a pipe. Pools start filled with seeded bytes so that a write that
touches anything it should not is caught.
"""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import replace

import pytest
import torch

from kv_store.layout import KVBlockLayout
from kv_transfer.codec import quantize_blocks
from kv_transfer.errors import KVTransferError, TransferTimeout
from kv_transfer.nixl_transport import NixlMemory, NixlTransport, PeerPool, TransferState
from kv_transfer.segments import head_slice_ranges

pytestmark = pytest.mark.integration

LAYOUT = KVBlockLayout(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, kv_dtype="fp8_e4m3")
RECEIVER_BLOCKS = 24
WRITER_BLOCKS = 16
TIMEOUT_S = 10.0


def _seeded_pool(num_blocks: int, block_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8, generator=g)


def _receiver_main(conn, progress_thread: bool) -> None:
    """The decode side: a transport over a seeded pool, driven by (method, args) commands.

    Without a progress thread it calls progress() while it waits for a command, as a decode
    worker waiting for KV polls its notifications; with one it blocks on the pipe.
    """
    pool = _seeded_pool(RECEIVER_BLOCKS, LAYOUT.block_bytes, seed=1)
    transport = NixlTransport("receiver", pool, progress_thread=progress_thread)
    commands = {
        "metadata": transport.metadata,
        "wait_notif": transport.wait_notif,
        "pop_notifs": transport.pop_notifs,
        "pool": lambda: pool.clone(),
        "close": lambda: (transport.num_open_handles(), transport.close()),
    }
    while True:
        while not progress_thread and not conn.poll(0.001):
            transport.progress()
        method, args = conn.recv()
        try:
            conn.send(("ok", commands[method](*args)))
        except KVTransferError as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        if method == "close":
            return


class Receiver:
    def __init__(self, progress_thread: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver_main, args=(child, progress_thread), daemon=True)
        self.process.start()

    def __call__(self, method: str, *args):
        self._conn.send((method, args))
        if not self._conn.poll(30):
            raise AssertionError(f"receiver did not answer {method!r}")
        status, value = self._conn.recv()
        if status == "error":
            raise AssertionError(f"receiver {method!r} failed: {value}")
        return value

    def close(self) -> int:
        num_open, _ = self("close")
        self.process.join(10)
        return num_open


@pytest.fixture(scope="module")
def receiver():
    peer = Receiver()
    yield peer
    assert peer.close() == 0


@pytest.fixture(scope="module")
def writer_pool():
    return _seeded_pool(WRITER_BLOCKS, LAYOUT.block_bytes, seed=2)


@pytest.fixture(scope="module")
def writer(receiver, writer_pool):
    transport = NixlTransport("writer", writer_pool)
    assert transport.add_peer(receiver("metadata")) == "receiver"
    yield transport
    transport.close()


@pytest.fixture(autouse=True)
def no_leaked_handles(request):
    yield
    if "writer" in request.fixturenames:
        assert request.getfixturevalue("writer").num_open_handles() == 0


def test_written_blocks_land_exactly_and_the_rest_stay_untouched(receiver, writer, writer_pool):
    before = receiver("pool")
    local_ids, remote_ids = [3, 4, 5, 9, 12], [7, 8, 9, 1, 14]
    with writer.write_blocks("receiver", local_ids, remote_ids, b"req-1") as handle:
        assert handle.num_descriptors == 3  # 3,4,5 -> 7,8,9 coalesce; 9 -> 1 and 12 -> 14 stay apart
        assert handle.num_bytes == 5 * LAYOUT.block_bytes
        handle.wait(TIMEOUT_S)
        assert handle.poll() is TransferState.DONE
    assert receiver("wait_notif", b"req-1", TIMEOUT_S) == "writer"
    after = receiver("pool")
    assert torch.equal(after[remote_ids], writer_pool[local_ids])
    untouched = [b for b in range(RECEIVER_BLOCKS) if b not in remote_ids]
    assert torch.equal(after[untouched], before[untouched])


def test_tensor_parallel_ranks_write_their_heads_into_whole_blocks(receiver, writer):
    """Rank 0 holds head 0, rank 1 heads 1-2, each in its own pool; together they fill whole blocks."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, *LAYOUT.payload_shape, generator=g)
    remote_ids = [20, 21]
    before = receiver("pool")
    ranks = []
    for rank, (head_start, head_end) in enumerate([(0, 1), (1, 3)]):
        shard_layout = replace(LAYOUT, num_kv_heads=head_end - head_start)
        pool = torch.zeros(4, shard_layout.block_bytes, dtype=torch.uint8)
        quantize_blocks(kv[:, head_start:head_end], shard_layout, out=pool[1:3])
        ranks.append(NixlTransport(f"writer-rank-{rank}", pool))
        ranks[-1].add_peer(receiver("metadata"))
        local_ranges, remote_ranges = head_slice_ranges(LAYOUT, head_start, head_end)
        notif = f"req-2/rank-{rank}".encode()
        with ranks[-1].write_blocks(
            "receiver", [1, 2], remote_ids, notif, byte_ranges=local_ranges, remote_byte_ranges=remote_ranges
        ) as handle:
            handle.wait(TIMEOUT_S)
        assert receiver("wait_notif", notif, TIMEOUT_S) == f"writer-rank-{rank}"
        if rank == 0:
            after = receiver("pool")[remote_ids]
            written = torch.zeros(LAYOUT.block_bytes, dtype=torch.bool)
            for r in remote_ranges:
                written[r.start : r.stop] = True
            assert torch.equal(after[:, ~written], before[remote_ids][:, ~written])
            assert not torch.equal(after[:, written], before[remote_ids][:, written])
    whole = quantize_blocks(kv, LAYOUT)
    padding = torch.ones(LAYOUT.block_bytes, dtype=torch.bool)
    for head_start, head_end in [(0, 1), (1, 3)]:
        for r in head_slice_ranges(LAYOUT, head_start, head_end)[1]:
            padding[r.start : r.stop] = False
    after = receiver("pool")[remote_ids]
    assert torch.equal(after[:, ~padding], whole[:, ~padding])
    for rank in ranks:
        assert rank.num_open_handles() == 0
        rank.close()


def test_concurrent_writers_on_one_transport(receiver, writer, writer_pool):
    errors = []

    def write(thread: int) -> None:
        try:
            for i in range(3):
                block = thread * 3 + i
                with writer.write_blocks("receiver", [block], [block], f"t{thread}-{i}".encode()) as handle:
                    handle.wait(TIMEOUT_S)
        except KVTransferError as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for thread in range(4):
        for i in range(3):
            assert receiver("wait_notif", f"t{thread}-{i}".encode(), TIMEOUT_S, "writer") == "writer"
    assert torch.equal(receiver("pool")[:12], writer_pool[:12])


def test_a_write_of_no_blocks_still_notifies(receiver, writer):
    handle = writer.write_blocks("receiver", [], [], b"req-empty")
    assert handle.poll() is TransferState.DONE and handle.num_bytes == 0
    handle.release()
    assert receiver("wait_notif", b"req-empty", TIMEOUT_S) == "writer"


def test_pop_notifs_returns_each_notification_once(receiver, writer):
    receiver("pop_notifs")
    for notif in (b"a", b"b"):
        with writer.write_blocks("receiver", [0], [0], notif) as handle:
            handle.wait(TIMEOUT_S)
    receiver("wait_notif", b"b", TIMEOUT_S)
    assert receiver("pop_notifs") == {"writer": [b"a"]}
    assert receiver("pop_notifs") == {}


def test_bad_writes_raise_before_reaching_nixl(receiver, writer):
    with pytest.raises(KVTransferError, match=r"unknown peer 'nobody': add_peer\(\) its metadata first"):
        writer.write_blocks("nobody", [0], [0], b"x")
    with pytest.raises(KVTransferError, match=rf"remote_block_ids: \[{RECEIVER_BLOCKS}\] outside"):
        writer.write_blocks("receiver", [0], [RECEIVER_BLOCKS], b"x")
    with pytest.raises(KVTransferError, match=rf"local_block_ids: \[{WRITER_BLOCKS}\] outside"):
        writer.write_blocks("receiver", [WRITER_BLOCKS], [0], b"x")
    with pytest.raises(KVTransferError, match="notif: must be non-empty bytes"):
        writer.write_blocks("receiver", [0], [0], b"")
    with pytest.raises(KVTransferError, match="peer metadata: not NixlTransport metadata"):
        writer.add_peer(b"garbage")
    with pytest.raises(KVTransferError, match="is this transport's own agent"):
        writer.add_peer(writer.metadata())
    with pytest.raises(KVTransferError, match="remove_peer: unknown peer 'nobody'"):
        writer.remove_peer("nobody")
    with pytest.raises(KVTransferError, match="pool: expected a contiguous CPU or CUDA uint8"):
        NixlTransport("bad", torch.zeros(4, 8, dtype=torch.float32))
    with pytest.raises(KVTransferError, match=r"pool: expected a contiguous CPU or CUDA uint8 \[num_blocks, block_bytes\] tensor, got torch.uint8 \[4, 8\] on meta"):
        NixlTransport("bad", torch.zeros(4, 8, dtype=torch.uint8, device="meta"))


def test_waiting_for_a_notification_that_never_comes_times_out(writer):
    with pytest.raises(TransferTimeout, match="b'never' not received within 0.05 s"):
        writer.wait_notif(b"never", 0.05)


def test_add_peer_is_idempotent_and_remove_peer_forgets(receiver, writer):
    metadata = receiver("metadata")
    assert writer.add_peer(metadata) == "receiver"
    writer.remove_peer("receiver")
    assert not writer.has_peer("receiver")
    with pytest.raises(KVTransferError, match="unknown peer 'receiver'"):
        writer.write_blocks("receiver", [0], [0], b"x")
    assert writer.add_peer(metadata) == "receiver"
    with writer.write_blocks("receiver", [1], [1], b"after-readd") as handle:
        handle.wait(TIMEOUT_S)
    assert receiver("wait_notif", b"after-readd", TIMEOUT_S) == "writer"


def test_a_closed_transport_refuses_work_and_releases_its_handles(receiver):
    transport = NixlTransport("short-lived", torch.zeros(2, LAYOUT.block_bytes, dtype=torch.uint8))
    transport.add_peer(receiver("metadata"))
    handle = transport.write_blocks("receiver", [0], [23], b"last")
    transport.close()
    assert transport.num_open_handles() == 0
    with pytest.raises(KVTransferError, match="the transport was closed"):
        handle.poll()
    with pytest.raises(KVTransferError, match="transport 'short-lived' is closed"):
        transport.write_blocks("receiver", [0], [0], b"x")
    transport.close()


def test_a_receiver_with_a_progress_thread_needs_no_polling(writer_pool):
    receiver = Receiver(progress_thread=True)  # blocks on its pipe between commands
    with NixlTransport("writer-2", writer_pool) as writer:
        writer.add_peer(receiver("metadata"))
        with writer.write_blocks("receiver", [0, 1], [5, 6], b"unpolled") as handle:
            handle.wait(TIMEOUT_S)
        assert torch.equal(receiver("pool")[5:7], writer_pool[:2])
        # The notification may trail the data by a moment (a busy core delays the progress thread).
        assert receiver("wait_notif", b"unpolled", TIMEOUT_S) == "writer-2"
        assert not any(receiver("pop_notifs").values())  # consumed once
    assert receiver.close() == 0


def test_a_cpu_pool_registers_as_dram_and_its_peers_learn_it(receiver, writer):
    assert writer.memory == NixlMemory("DRAM", 0)
    peer = PeerPool.decode(receiver("metadata"))
    assert (peer.mem_type, peer.device_id) == ("DRAM", 0)


@pytest.mark.gpu
def test_a_gpu_pool_registers_as_vram_and_writes_into_a_cpu_peer(receiver):
    """VRAM descriptors on the writer's side, DRAM on the receiver's (its metadata says so): UCX's CUDA transports move them."""
    pool = _seeded_pool(4, LAYOUT.block_bytes, seed=4).to("cuda:0")
    with NixlTransport("gpu-writer", pool) as writer:
        assert writer.memory == NixlMemory("VRAM", 0)
        assert PeerPool.decode(writer.metadata()).mem_type == "VRAM"
        writer.add_peer(receiver("metadata"))
        with writer.write_blocks("receiver", [1, 2, 3], [10, 11, 15], b"from-vram") as handle:
            handle.wait(TIMEOUT_S)
        assert receiver("wait_notif", b"from-vram", TIMEOUT_S) == "gpu-writer"
        assert torch.equal(receiver("pool")[[10, 11, 15]], pool[1:].cpu())
