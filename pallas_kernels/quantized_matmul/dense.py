"""The dense (unquantized) matmul of the CPU's bf16 serving path: `x @ w` with f32 sums.

XLA:CPU (jax 0.10) runs a bf16 dot of one row at 1-10 GFLOP/s (SmolLM2's 576 x 49152 head:
37 ms, against 2.7 ms in f32), and copies each layer's slice of a stacked weight inside the
layer scan. The native CPU matmul (cpu.py, the int8 kernel's paths with bf16 weights) reads
the stacked weight in place by layer index, streams a decode step's few rows at the
memory's speed and runs many rows on VDPBF16PS (AVX512-BF16). Elsewhere (TPU, GPU, f32
weights, a CPU without the kernel) the reference: XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import by_target_platform
from pallas_kernels._validate import check_float, check_matmul_operands
from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.reference import check_glu, gated


def _validate(x, w, layer, transposed, residual, out_dtype, rows) -> None:
    check_matmul_operands(x, w, layer, transposed, residual, rows)
    check_float("x", x)
    check_float("w", w)
    if residual is not None:
        if residual.dtype != out_dtype:
            raise ValueError(f"residual must be {out_dtype} like the result, got {residual.dtype}")


def dense_matmul_reference(x: jax.Array, w: jax.Array, layer: jax.Array | int | None = None, *,
                           transposed: bool = False, residual: jax.Array | None = None,
                           out_dtype: jnp.dtype | None = None, glu: str | None = None) -> jax.Array:
    """The contract: x [M, K] @ w [K, N] (layer `layer` of [L, K, N]; w [N, K] when
    `transposed`), products summed in f32, cast to `out_dtype` (x's dtype by default; f32
    keeps the sums: a head's logits), then `residual +` that; or with `glu` the gated
    activation of that (`reference.gated`: [M, N / 2])."""
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    out = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    out = out.astype(x.dtype if out_dtype is None else out_dtype)
    return gated(out, glu) if residual is None else residual + out


def native_dense_available(w_dtype) -> bool:
    """Whether a program compiled here for this CPU runs `dense_matmul` on the native kernel:
    bf16 weights, the CPU as the default backend, the kernel built (builds it on first call)."""
    return (jnp.dtype(w_dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"
            and native_cpu.available()[0])


def dense_matmul(
    x: jax.Array,  # [M, K] bf16 (or f32)
    w: jax.Array,  # [K, N], or [L, K, N] with `layer`; [N, K] with `transposed`
    *,
    layer: jax.Array | int | None = None,  # int32 scalar: which stacked layer
    transposed: bool = False,
    residual: jax.Array | None = None,  # [M, N], x.dtype
    rows: jax.Array | int | None = None,  # int32 scalar: the live rows of x (None: all)
    out_dtype: jnp.dtype | None = None,  # x's dtype (None) or float32
    glu: str | None = None,  # "silu": the gated activation of the result, [M, N / 2]
) -> jax.Array:  # [M, N] (or [M, N / 2] with glu), out_dtype
    """`x @ w` (+ `residual`), f32 sums. On CPU with bf16 weights the native kernel: rows at
    and past `rows` are written 0 there (padding), the reference computes them. The native
    kernel sums in another order than XLA (and VDPBF16PS flushes bf16 subnormals), so the two
    agree to f32 rounding of the sums, then bf16 rounding of the result."""
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or float32, got {out_dtype}")
    _validate(x, w, layer, transposed, residual, out_dtype, rows)
    check_glu(glu, w.shape[-2] if transposed else w.shape[-1], residual, transposed)
    if glu is not None and out_dtype != x.dtype:
        raise ValueError(f"glu writes x's dtype ({x.dtype}), not {out_dtype}")
    stacked = layer is not None
    index = jnp.asarray(layer if stacked else 0, jnp.int32).reshape(())
    live = jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())
    operands = (x, w, index, live) + (() if residual is None else (residual,))

    def reference(x, w, index, live, *res):
        return dense_matmul_reference(x, w, index if stacked else None, transposed=transposed,
                                      residual=res[0] if res else None, out_dtype=out_dtype, glu=glu)

    def native(x, w, index, live, *res):
        return native_cpu.quantized_matmul_cpu(x, w, None, index if stacked else None, transposed=transposed,
                                               residual=res[0] if res else None, rows=live, precision="bf16",
                                               out_dtype=out_dtype, glu=glu)

    native_ok = x.dtype == jnp.bfloat16 and native_dense_available(w.dtype)
    return by_target_platform(operands, reference=reference, tpu=None, gpu=None, cpu=native if native_ok else None)
