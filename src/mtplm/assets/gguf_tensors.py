"""Where a GGUF's tensors lie (name, block type, shape, data offset), read from its header alone.

gguf-py's GGUFReader parses every metadata value into numpy objects: a 150k-token vocabulary and its merges
become about a million of them, seconds and hundreds of MB that a quantized model's load needs none of
(its tokenizer comes from the converted directory). This walks the header once over a memory map, skipping
the values it does not need, and reads the architecture name, the alignment and the tensor infos (GGUF
versions 2 and 3, little-endian: what llama.cpp writes). Another file is read by GGUFReader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF metadata value types: bytes of a scalar (8: string, 9: array, read apart)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF: its block type (GGMLQuantizationType's name), shape as GGUF orders it (the
    innermost dimension first, as GGUFReader's `shape`) and where its data begins in the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data_offset: int


@dataclass(frozen=True)
class Header:
    architecture: str
    tensors: dict[str, TensorInfo]


def read_header(path: Path) -> Header:
    """The architecture and tensor infos of the GGUF at `path`."""
    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
            return _by_gguf_reader(path)
        return _Walk(data).header()


class _Walk:
    """A cursor over a GGUF's header bytes."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 8

    def take(self, form: str) -> int:
        (value,) = struct.unpack_from(form, self.data, self.at)
        self.at += struct.calcsize(form)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        self.at += length
        return self.data[self.at - length : self.at].decode("utf-8")

    def skip(self, kind: int) -> None:
        """Past one value of type `kind` (an array: its items)."""
        if kind == _STRING:
            length = self.take("<Q")  # not `self.at += self.take(...)`: `+=` reads `at` before take moves it
            self.at += length
        elif kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALAR_BYTES:
                self.at += _SCALAR_BYTES[item] * count
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.at += _SCALAR_BYTES[kind]

    def header(self) -> Header:
        from gguf import GGMLQuantizationType

        tensor_count, kv_count = self.take("<Q"), self.take("<Q")
        architecture, alignment = "", 32
        for _ in range(kv_count):
            key, kind = self.string(), self.take("<I")
            if key == "general.architecture" and kind == _STRING:
                architecture = self.string()
            elif key == "general.alignment" and kind == _UINT32:
                alignment = self.take("<I")
            else:
                self.skip(kind)
        infos = []
        for _ in range(tensor_count):
            name, dims = self.string(), self.take("<I")
            shape = tuple(self.take("<Q") for _ in range(dims))
            infos.append((name, GGMLQuantizationType(self.take("<I")).name, shape, self.take("<Q")))
        start = -(-self.at // alignment) * alignment
        tensors = {name: TensorInfo(name, kind, shape, start + offset) for name, kind, shape, offset in infos}
        return Header(architecture, tensors)


def _by_gguf_reader(path: Path) -> Header:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {
        t.name: TensorInfo(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.data_offset))
        for t in reader.tensors
    }
    return Header(str(reader.fields["general.architecture"].contents()), tensors)
