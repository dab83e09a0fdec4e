"""Host-side copies of the weight loader: transposed and cast in one pass, into aligned buffers.

A checkpoint holds projections [out, in]; jaxserve keeps them [in, out]. numpy transposes
16-bit data at ~0.3-0.6 GB/s (a strided element loop); a small native library (built once per
host, like the CPU kernels) does it tile by tile at several GB/s, converting bf16 / f16 / f32
to f32 or bf16 on the way, and runs outside the GIL so loader threads overlap. Where no C++
compiler is available numpy does the same copies, slower.

Buffers are 64-byte aligned: on a CPU backend a read-only aligned host array becomes a device
array without a copy (`jax.device_put(..., may_alias=True)`), so the weights exist once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import ml_dtypes
import numpy as np

logger = logging.getLogger(__name__)

ALIGNMENT = 64
_CODES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1, np.dtype(np.float16): 2}
_SOURCE = Path(__file__).with_name("copy_kernels.cc")


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    from pallas_kernels._native_cpu import build

    path, why, _ = build(_SOURCE, "jaxserve_loader_copy", "loader's copy kernels")
    if path is None:
        logger.warning("weights are transposed by numpy (slower): %s", why)
        return None, why
    lib = ctypes.CDLL(str(path))
    for fn in (lib.jaxserve_transpose_copy, lib.jaxserve_cast_copy):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
        fn.restype = ctypes.c_int
    lib.jaxserve_dequantize_gguf.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.jaxserve_dequantize_gguf.restype = ctypes.c_int
    return lib, why


def native_available() -> tuple[bool, str]:
    lib, why = _library()
    return lib is not None, why


# GGUF block formats with a native kernel: ggml type id -> bytes per block of 32 values.
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0


def dequantize_gguf(type_id: int, raw: np.ndarray) -> np.ndarray | None:
    """The f32 values of `raw` (a GGUF tensor's bytes in block format `type_id`); None when
    there is no native kernel for the format (the caller uses numpy)."""
    lib = _library()[0]
    size = GGUF_BLOCK_BYTES.get(type_id)
    if lib is None or size is None or raw.size % size:
        return None
    raw = np.ascontiguousarray(raw.reshape(-1).view(np.uint8))
    out = aligned_empty((raw.size // size * 32,), np.float32)
    if lib.jaxserve_dequantize_gguf(type_id, raw.ctypes.data, raw.size // size, out.ctypes.data) != 0:
        return None
    return out


def _rows(a: np.ndarray) -> tuple[int, int, int] | None:
    """(rows, cols, row stride in elements) of a 2-D array with unit column stride."""
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize or a.strides[0] < 0:
        return None
    return a.shape[0], a.shape[1], a.strides[0] // a.itemsize


def copy_into(src: np.ndarray, dst: np.ndarray, transpose: bool = False) -> None:
    """`dst[...] = src.T` (2-D, `transpose`) or `dst[...] = src`, cast to dst's dtype (f32 or
    bf16 from f32 / bf16 / f16 natively; anything numpy casts otherwise)."""
    if transpose and (src.ndim != 2 or dst.shape != src.shape[::-1]):
        raise ValueError(f"cannot transpose {src.shape} into {dst.shape}")
    if not transpose and dst.shape != src.shape:
        raise ValueError(f"cannot copy {src.shape} into {dst.shape}")
    if not transpose and src.ndim == 2 and src.T.flags.c_contiguous and not src.flags.c_contiguous:
        src, transpose = src.T, True  # a transposed view: copy it as the transpose of its memory
    lib = _library()[0] if src.size >= 4096 else None
    s_code, d_code = _CODES.get(src.dtype), _CODES.get(dst.dtype)
    if lib is not None and s_code is not None and d_code in (0, 1):
        s2 = src if src.ndim == 2 else (src.reshape(1, -1) if src.flags.c_contiguous else None)
        d2 = dst if dst.ndim == 2 else (dst.reshape(1, -1) if dst.flags.c_contiguous else None)
        s_rows = _rows(s2) if s2 is not None else None
        d_rows = _rows(d2) if d2 is not None else None
        if s_rows is not None and d_rows is not None and (transpose or s_rows[:2] == d_rows[:2]):
            rows, cols, s_ld = s_rows
            fn = lib.jaxserve_transpose_copy if transpose else lib.jaxserve_cast_copy
            if fn(src.ctypes.data, s_code, rows, cols, s_ld, dst.ctypes.data, d_code, d_rows[2]) == 0:
                return
    dst[...] = src.T if transpose else src
