"""One safetensors file read from its layout: an 8-byte little-endian header length, a JSON
header (dtype, shape and data offsets per tensor), then the data.

Tensors are read with `os.preadv` straight into the caller's buffer (the final params array
when no conversion is needed, else a reused scratch buffer): no memory map, so the file's
pages never count as this process's memory, and no framework reader, which would build a
device array (and compile a program) per tensor. The header is checked against the file's
size when it is opened, so a truncated or corrupt file is named before anything is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import ml_dtypes
import numpy as np

from jaxserve.loading.errors import CheckpointError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 << 20


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class SafetensorsFile:
    """The tensors of one file; reads are thread-safe (positioned reads on one descriptor)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = -1
        self.bytes_read = 0  # by every read so far
        self._lock = threading.Lock()
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open safetensors file {path}: {e.strerror}") from None
        try:
            self.tensors = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"safetensors file {self.path} is not a safetensors file or is truncated "
                                  f"({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"safetensors file {self.path}: its header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"safetensors file {self.path}: its header is not a JSON object")
        data_start, out = 8 + n, {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
                what = entry.get("dtype") if isinstance(entry, dict) else entry
                raise CheckpointError(f"safetensors file {self.path}: tensor {name!r} has dtype {what!r}, which "
                                      "jaxserve does not read")
            try:
                dtype = np.dtype(DTYPES[entry["dtype"]])
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"safetensors file {self.path}: tensor {name!r} has a malformed header "
                                      f"entry {entry!r}") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"safetensors file {self.path}: tensor {name!r} holds {end - begin} bytes, "
                                      f"its shape {shape} and dtype {entry['dtype']} need {nbytes}")
            if data_start + end > size:
                raise CheckpointError(f"safetensors file {self.path} is truncated: tensor {name!r} ends at byte "
                                      f"{data_start + end}, the file has {size}")
            out[name] = TensorInfo(dtype, shape, data_start + begin, nbytes)
        return out

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor, read into `out` (C-contiguous, the tensor's dtype and size) or a new array."""
        info = self.tensors[name]
        if out is None:
            out = np.empty(info.shape, info.dtype)
        elif out.dtype != info.dtype or out.nbytes != info.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"cannot read {name!r} ({info.dtype}, {info.shape}) into {out.dtype} {out.shape}")
        self._pread(name, out, info.offset)
        return out.reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Rows [start, stop) of the tensor (along its first axis: one contiguous read) into
        `out` (C-contiguous, the tensor's dtype, `stop - start` rows)."""
        info = self.tensors[name]
        row = info.nbytes // max(info.shape[0], 1)
        self._check_part(name, info, out, (stop - start) * row, start, stop, info.shape[0])
        self._pread(name, out, info.offset + start * row)
        return out.reshape(stop - start, *info.shape[1:])

    def read_columns(self, name: str, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Columns [start, stop) of a 2-D tensor into `out` ([rows, stop - start], C-contiguous):
        one positioned read per row."""
        info = self.tensors[name]
        rows, cols = info.shape
        width = stop - start
        self._check_part(name, info, out, rows * width * info.dtype.itemsize, start, stop, cols)
        out = out.reshape(rows, width)
        item = info.dtype.itemsize
        for i in range(rows):
            self._pread(name, out[i], info.offset + (i * cols + start) * item)
        return out

    def _check_part(self, name: str, info: TensorInfo, out: np.ndarray, nbytes: int, start: int, stop: int,
                    extent: int) -> None:
        if not 0 <= start < stop <= extent:
            raise ValueError(f"{name!r}: range [{start}, {stop}) is outside its {extent}")
        if out.dtype != info.dtype or out.nbytes != nbytes or not out.flags.c_contiguous:
            raise ValueError(f"cannot read part of {name!r} ({info.dtype}, {info.shape}) into {out.dtype} "
                             f"{out.shape}")

    def _pread(self, name: str, out: np.ndarray, offset: int) -> None:
        """Fills `out` (contiguous) from the file at `offset`."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < view.nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"safetensors file {self.path}: reading tensor {name!r} stopped at byte "
                                      f"{offset + done} (the file changed or shrank while loading)")
            done += got
        with self._lock:
            self.bytes_read += done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


_scratch = threading.local()


def scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable byte buffer of at least `nbytes` (grown, never shrunk; freed
    with the thread: the loader's pool threads end with the load), so reading a tensor that
    is converted afterwards allocates nothing."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buf[:nbytes]
