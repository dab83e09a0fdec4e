"""A fast reader of GGUF headers: metadata as Python values, tensors as memory-mapped views.

`gguf.GGUFReader` builds a numpy view per array element while parsing, which made opening
the embedded model's file (a 49k-token vocabulary and its merges) take ~4 s of every start;
this reads the same header with `struct` in ~0.1 s. Only little-endian GGUF v2/v3 is read
here: anything else raises `GGUFFormatError`, and the caller falls back to `gguf.GGUFReader`.
Values and tensor views equal what `GGUFReader` gives (tests/test_loading.py compares).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

_SCALARS = {  # GGUF value type -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFormatError(ValueError):
    """A header this reader does not handle (or a damaged one)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (innermost first)
    data: np.ndarray  # memory-mapped: the element type for float/int tensors, else uint8 rows


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf = memoryview(buf)
        self.pos = 0

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("truncated header")
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out if len(out) > 1 else out[0]

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("truncated string")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY:  # a numeric array in one read
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError("truncated array")
                arr = np.frombuffer(self.buf[self.pos : end], dt)
                self.pos = end
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype])


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, tensors by name) of a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    cur = _Cursor(data)
    if cur.unpack("4s") != b"GGUF":
        raise GGUFFormatError("not a GGUF file (bad magic)")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (or a big-endian file)")
    n_tensors, n_kv = cur.unpack("QQ")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = tuple(cur.unpack("Q") for _ in range(n_dims))
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    elem_types = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"duplicated tensor {name!r}")
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        begin = start + offset
        if qtype in elem_types:
            dt = np.dtype(elem_types[qtype])
            count = n_elems
        else:
            dt, count = np.dtype(np.uint8), n_elems * type_size // block
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        end = begin + count * dt.itemsize
        if end > len(data):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        tensors[name] = GGUFTensor(name, qtype, dims, data[begin:end].view(dt).reshape(np_dims))
    return meta, tensors
