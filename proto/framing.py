"""How protobuf messages sit on a request-plane connection (see worker.proto): each one is its
serialized length as a 4-byte big-endian unsigned int, then the serialized bytes.

Part of the wire format, like the generated code beside it; both ends import it from here.
"""

from __future__ import annotations

import asyncio
import struct

from google.protobuf.message import Message

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20
"""The largest frame either end accepts (a prompt at the router's size limit fits many times over)."""


class FrameTooLarge(Exception):
    """The peer announced a frame over the reader's limit; the connection is unusable after it."""


def frame(message: Message) -> bytes:
    data = message.SerializeToString()
    return _LENGTH.pack(len(data)) + data


def write_frame(writer: asyncio.StreamWriter, message: Message) -> None:
    writer.write(frame(message))


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame's payload. Raises asyncio.IncompleteReadError when the peer closed the
    connection (``partial`` is empty at a frame boundary) and FrameTooLarge over ``max_bytes``."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > max_bytes:
        raise FrameTooLarge(f"frame of {size} bytes is over the limit of {max_bytes}")
    return await reader.readexactly(size)
