"""NixlTransport's metadata envelope: a fixed header, the agent name, NIXL's blob; no NIXL needed."""

import struct

import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_transport import PeerPool

POOL = PeerPool("decode-0", base_address=0x7F00_0000_1000, block_bytes=185040, num_blocks=512, nixl_metadata=b"\x01nixl")


def test_round_trip_and_exact_size():
    data = POOL.encode()
    assert len(data) == 38 + len(b"decode-0") + len(b"\x01nixl")
    assert PeerPool.decode(data) == POOL


def test_malformed_metadata_is_refused():
    data = POOL.encode()
    with pytest.raises(KVTransferError, match="not NixlTransport metadata"):
        PeerPool.decode(b"\x00" + data[1:])
    with pytest.raises(KVTransferError, match=r"header announces 51"):
        PeerPool.decode(data[:-1])
    newer = data[:6] + struct.pack("<H", 2) + data[8:]
    with pytest.raises(KVTransferError, match="format version 2, this transport reads 1"):
        PeerPool.decode(newer)
