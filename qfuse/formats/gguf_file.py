"""The GGUF container read with `struct` and a numpy memmap: `GGUFFile(path)` gives the
metadata (`metadata`, key → Python value) and the tensor table (`tensors`: name, GGML type
name, shape, and the bytes as a uint8 view of the mapped file), nothing converted.

Layout (GGUF v2/v3, little-endian): "GGUF", version u32, tensor count u64, key/value count
u64; each key/value: key (u64 length + UTF-8), value type u32, value (strings as length +
bytes, arrays as element type u32 + count u64 + elements); each tensor: name, dimension
count u32, dimensions u64 (the first the fastest-varying), GGML type u32, offset u64 from the
start of the data, which begins at the next multiple of `general.alignment` (32 if absent).

Why not the `gguf` package's GGUFReader: it builds numpy views for every string of the
metadata, so a file with a 150k-token vocabulary and as many merges takes about 18 s to open
on our 2-core machines, against ~0.5 s here; qfuse opens a file more than once (the checks
before loading, the tokenizer, the weights). Truncated or malformed files raise FormatError
(one line); tensor bytes are read only when a caller copies them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .groups import FormatError

# GGML type id → (name, values per block, bytes per block): ggml's type table.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Metadata value types: scalars (struct format) and their numpy twins for arrays.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # as GGUF lists it: the first dimension the fastest (columns)
    data: np.ndarray  # uint8 [rows, row bytes] (rows: the product of the other dimensions)


class _Cursor:
    """Little-endian reads from a buffer; a read past its end is a truncated file."""

    def __init__(self, buf: memoryview, path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise FormatError(f"{self.path} is truncated (its header ends at byte {self.at})")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise FormatError(f"{self.path} is truncated (its header ends at byte {self.at})")
        raw = bytes(self.buf[self.at:self.at + n])
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{self.path}: a metadata string at byte {self.at - n} is not "
                              "UTF-8 (not a GGUF file?)") from e

    def value(self, kind: int, key: str):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind != _ARRAY:
            raise FormatError(f"{self.path}: metadata {key} has value type {kind}, which GGUF "
                              "does not define")
        sub, n = self.take("<I"), self.take("<Q")
        if sub in _SCALARS:
            dtype = np.dtype(_SCALARS[sub])
            if self.at + n * dtype.itemsize > len(self.buf):
                raise FormatError(f"{self.path} is truncated (metadata {key} runs past its end)")
            out = np.frombuffer(self.buf, dtype, n, self.at).tolist()
            self.at += n * dtype.itemsize
            return out
        return [self.value(sub, key) for _ in range(n)]


class GGUFFile:
    """One .gguf file's metadata and tensor table; FormatError (one line) for a file that
    is not GGUF, is truncated, or lists a tensor type ggml does not define."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ValueError as e:  # numpy refuses to map an empty file
            raise FormatError(f"{self.path} is truncated or not a GGUF file ({e})") from e
        cur = _Cursor(memoryview(mapped), self.path)
        if len(mapped) < 4 or bytes(mapped[:4]) != b"GGUF":
            raise FormatError(f"{self.path} is not a GGUF file (it does not start with GGUF)")
        cur.at = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise FormatError(f"{self.path}: GGUF version {version} is not read (qfuse reads "
                              "versions 2 and 3, little-endian)")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"), key)
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            kind, offset = cur.take("<I"), cur.take("<Q")
            if kind not in GGML_TYPES:
                raise FormatError(f"{self.path}: tensor {name} has GGML type {kind}, which "
                                  "qfuse does not know")
            table.append((name, dims, kind, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.at // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in table:
            type_name, per, nbytes = GGML_TYPES[kind]
            cols = dims[0] if dims else 1
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            if cols % per:
                raise FormatError(f"{self.path}: tensor {name} has rows of {cols} values, not "
                                  f"whole {type_name} blocks of {per}")
            row_bytes = cols // per * nbytes
            begin, end = start + offset, start + offset + rows * row_bytes
            if end > len(mapped):
                have = max(0, len(mapped) - begin)
                raise FormatError(f"{self.path} is truncated: tensor {name} has {have} of its "
                                  f"{rows * row_bytes} bytes")
            data = mapped[begin:end].reshape(rows, row_bytes)
            self.tensors.append(TensorInfo(name, type_name, dims, data))
