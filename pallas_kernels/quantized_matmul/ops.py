"""Public entry point for the weight-quantized matmul: validate, then dispatch by backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._validate import check_float, check_shape
from pallas_kernels.quantized_matmul.reference import quantized_matmul_reference

QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
BACKENDS = ("auto", "reference")


def _validate(x, w, scale, layer) -> None:
    check_shape("x", x, (None, None), "[M, K]")
    k = x.shape[1]
    if layer is None:
        check_shape("w", w, (k, None), "[K, N]")
        check_shape("scale", scale, (w.shape[1],), "[N]")
    else:
        check_shape("w", w, (None, k, None), "[L, K, N] (stacked, with layer)")
        check_shape("scale", scale, (w.shape[0], w.shape[2]), "[L, N]")
    check_float("x", x)
    if w.dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"w must be int8, float8_e4m3fn or float8_e5m2, got {w.dtype}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")


def quantized_matmul(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N] int8 / float8, or [L, K, N] with `layer`
    scale: jax.Array,  # [N] f32, or [L, N] with `layer`
    *,
    layer: jax.Array | int | None = None,  # int32 scalar: which stacked layer
    backend: str = "auto",
) -> jax.Array:  # [M, N], x.dtype
    """`(x @ w) * scale` with f32 accumulation (see reference.py for the contract).

    backend: "auto" (the platform's best path: XLA's dot with the conversion fused into the
    operand on TPU/GPU), "reference" (the oracle).
    """
    _validate(x, w, scale, layer)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return quantized_matmul_reference(x, w, scale, layer)
