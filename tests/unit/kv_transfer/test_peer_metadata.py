"""NixlTransport's metadata envelope: a fixed header, the agent name, NIXL's blob; no NIXL needed.
And the NIXL memory a pool registers as, by its device."""

import struct

import pytest

from kv_transfer.errors import KVTransferError
import torch

from kv_transfer.nixl_transport import NixlMemory, PeerPool, nixl_memory

POOL = PeerPool("decode-0", base_address=0x7F00_0000_1000, block_bytes=185040, num_blocks=512, nixl_metadata=b"\x01nixl")
GPU_POOL = PeerPool("decode-1", 0x7A00_0000_0000, 185040, 512, b"\x02nixl", mem_type="VRAM", device_id=3)


def test_round_trip_and_exact_size():
    data = POOL.encode()
    assert len(data) == 43 + len(b"decode-0") + len(b"\x01nixl")
    assert PeerPool.decode(data) == POOL
    assert PeerPool.decode(GPU_POOL.encode()) == GPU_POOL  # the far side's memory type and GPU travel with it
    assert (POOL.mem_type, POOL.device_id) == ("DRAM", 0)


def test_malformed_metadata_is_refused():
    data = POOL.encode()
    with pytest.raises(KVTransferError, match="not NixlTransport metadata"):
        PeerPool.decode(b"\x00" + data[1:])
    with pytest.raises(KVTransferError, match=r"header announces 56"):
        PeerPool.decode(data[:-1])
    newer = data[:6] + struct.pack("<H", 3) + data[8:]
    with pytest.raises(KVTransferError, match="format version 3, this transport reads 2"):
        PeerPool.decode(newer)
    with pytest.raises(KVTransferError, match=r"memory type 2 is none of \('DRAM', 'VRAM'\)"):
        PeerPool.decode(data[:38] + bytes([2]) + data[39:])


@pytest.mark.parametrize(
    "device, memory",
    [("cpu", NixlMemory("DRAM", 0)), ("cuda:0", NixlMemory("VRAM", 0)), ("cuda:3", NixlMemory("VRAM", 3))],
)
def test_a_pool_registers_as_dram_on_the_cpu_and_as_its_gpus_vram_on_cuda(device, memory):
    assert nixl_memory(torch.device(device)) == memory


@pytest.mark.parametrize("device", ["cuda", "meta", "mps"])
def test_a_pool_nixl_cannot_register_is_refused_by_name(device):
    with pytest.raises(ValueError, match=rf"device: {device} is not cpu or cuda:N, where a pool NIXL can register lives"):
        nixl_memory(torch.device(device))
