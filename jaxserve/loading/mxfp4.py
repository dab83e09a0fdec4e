"""MXFP4 tensors (the OCP microscaling format gpt-oss's experts are released in), decoded at load.

A weight [..., N, K] (N output rows, K inputs) is stored as
- `blocks` uint8 [..., N, K / 32, 16]: each block of 32 consecutive inputs, two FP4 (E2M1)
  values per byte, the low nibble first;
- `scales` uint8 [..., N, K / 32]: one power-of-two scale per block, E8M0 (2 ** (s - 127)).

An E2M1 nibble is a sign bit and 3 bits of magnitude, one of 0, 0.5, 1, 1.5, 2, 3, 4, 6. Every
decoded value times its power-of-two scale is exact in f32 and in bf16 (a 2-bit mantissa times
2^e), so the decode is lossless; requantizing the result to int8 (`quantization="int8"`) is not.
"""

from __future__ import annotations

import numpy as np

from jaxserve.loading.errors import CheckpointError

BLOCK = 32  # inputs per scale
# The 16 E2M1 codes: sign in bit 3, magnitude in bits 0-2.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def check_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str, rows: int | None = None,
                inputs: int | None = None) -> None:
    """Raises CheckpointError naming `name` unless blocks [..., N, K/32, 16] and scales
    [..., N, K/32] are uint8 of matching shapes (N == `rows`, K == `inputs` when given)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise CheckpointError(f"MXFP4 tensor {name!r}: blocks and scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK // 2:
        raise CheckpointError(f"MXFP4 tensor {name!r}: blocks have shape {blocks.shape}, expected "
                              f"[..., N, K/{BLOCK}, {BLOCK // 2}] (two 4-bit values per byte, {BLOCK} per block)")
    if scales.shape != blocks.shape[:-1]:
        raise CheckpointError(f"MXFP4 tensor {name!r}: scales have shape {scales.shape}, expected "
                              f"{blocks.shape[:-1]} (one per block of the blocks {blocks.shape})")
    n, k = blocks.shape[-3], blocks.shape[-2] * BLOCK
    if (rows is not None and n != rows) or (inputs is not None and k != inputs):
        raise CheckpointError(f"MXFP4 tensor {name!r}: blocks {blocks.shape} hold a [{n}, {k}] weight, expected "
                              f"[{rows}, {inputs}]")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """blocks [..., N, K/32, 16], scales [..., N, K/32] -> the f32 weight [..., N, K]."""
    check_mxfp4(blocks, scales, name)
    lo = E2M1_VALUES[blocks & 0x0F]  # [..., N, G, 16]: inputs 0, 2, 4, ... of each block
    hi = E2M1_VALUES[blocks >> 4]  # inputs 1, 3, 5, ...
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK)  # [..., N, G, 32]
    exponent = scales.astype(np.int32) - 127
    values = np.ldexp(values, exponent[..., None])
    return values.reshape(*blocks.shape[:-2], -1)
