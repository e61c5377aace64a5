"""The tensors of a GGUF file without its metadata: names, types, shapes and raw bytes.

``gguf.GGUFReader`` parses every metadata value into numpy views as it opens a file; for a
model with a 49k-token vocabulary (its tokens, scores, types and merges) that is about 2.8 s of
CPU, 60% of starting an engine with native weights, which only needs the tensors. This reads
the header, steps over the metadata by its lengths alone, and maps the tensor data::

    magic "GGUF" | version u32 | num_tensors u64 | num_kv u64
    num_kv x      key: string | value_type u32 | value (an array: elem_type u32 | count u64 | elems)
    num_tensors x name: string | num_dims u32 | dims u64 x num_dims | type u32 | offset u64
    padding to ``general.alignment`` (default 32) | tensor data (each at its offset)

A string is ``length u64 | bytes``; every number is little-endian. Dims run innermost first
(a ``[rows, cols]`` weight is stored as dims ``(cols, rows)``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from engine.errors import CheckpointError

_SCALARS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file."""

    name: str
    """Its GGUF name (``blk.0.attn_q.weight``)."""
    kind: str
    """Its GGUF type name (Q4_1, Q8_0, F32, ...)."""
    dims: tuple[int, ...]
    """Its dimensions as GGUF stores them, innermost first."""
    data: np.ndarray | None
    """Its raw bytes (``uint8``, mapped from the file); None for a type whose size is unknown here."""


def read_gguf_tensors(gguf_path: Path) -> list[GGUFTensor]:
    """Every tensor of the file, in file order; ``CheckpointError`` naming the file when it is
    not a GGUF file or is truncated."""
    try:
        raw = np.memmap(gguf_path, dtype=np.uint8, mode="r")
        return _Parser(raw).tensors()
    except (OSError, ValueError, struct.error, IndexError) as e:
        raise CheckpointError(f"{gguf_path}: not a readable GGUF file, truncated or corrupt? ({e})") from e


class _Parser:
    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw
        self.buffer = memoryview(raw)
        self.pos = 0

    def tensors(self) -> list[GGUFTensor]:
        if bytes(self.buffer[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        self.pos = 4
        version, num_tensors, num_kv = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(num_kv):
            key = self._string()
            value = self._value(self._unpack("<I")[0])
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            kind_id, offset = self._unpack("<IQ")
            infos.append((name, kind_id, dims, offset))
        data_start = -(-self.pos // alignment) * alignment
        return [self._tensor(name, kind_id, dims, data_start + offset) for name, kind_id, dims, offset in infos]

    def _tensor(self, name: str, kind_id: int, dims: tuple[int, ...], start: int) -> GGUFTensor:
        kind = gguf.GGMLQuantizationType(kind_id)
        sizes = gguf.GGML_QUANT_SIZES.get(kind)
        if sizes is None:
            return GGUFTensor(name, kind.name, dims, None)
        block_size, type_size = sizes
        num_bytes = int(np.prod(dims, dtype=np.int64)) // block_size * type_size
        if start + num_bytes > len(self.raw):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        return GGUFTensor(name, kind.name, dims, self.raw[start : start + num_bytes])

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self.pos + length
        if end > len(self.raw):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def _value(self, value_type: int):
        """The value (scalars and strings); an array is stepped over (None)."""
        if value_type == gguf.GGUFValueType.STRING:
            return self._string()
        if value_type == gguf.GGUFValueType.ARRAY:
            elem_type, count = self._unpack("<IQ")
            self._skip_array(elem_type, count)
            return None
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self._unpack("<" + fmt)[0]

    def _skip_array(self, elem_type: int, count: int) -> None:
        if elem_type in _SCALARS:
            self.pos += struct.calcsize("<" + _SCALARS[elem_type]) * count
        elif elem_type == gguf.GGUFValueType.STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", self.buffer, self.pos)
                self.pos += 8 + length
        else:
            for _ in range(count):
                self._value(elem_type)
        if self.pos > len(self.raw):
            raise ValueError("an array runs past the end of the file")
