"""Public entry point for the weight-quantized matmul: validate, then dispatch by backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import by_target_platform
from pallas_kernels._validate import check_float, check_matmul_operands, check_shape
from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.reference import check_glu, quantized_matmul_reference

QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
BACKENDS = ("auto", "reference", "cpu")


def _validate(x, w, scale, layer, transposed, residual, rows) -> None:
    check_matmul_operands(x, w, layer, transposed, residual, rows)
    if transposed:
        check_shape("scale", scale, (w.shape[0],), "[N]")
    elif layer is None:
        check_shape("scale", scale, (w.shape[1],), "[N]")
    else:
        check_shape("scale", scale, (w.shape[0], w.shape[2]), "[L, N]")
    check_float("x", x)
    if w.dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"w must be int8, float8_e4m3fn or float8_e5m2, got {w.dtype}")
    if scale.dtype != jnp.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if residual is not None:
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must be {x.dtype} like x, got {residual.dtype}")


def _native_cpu_choice(w_dtype, build: bool = True) -> tuple[bool | None, str]:
    """(whether `auto` may lower the native CPU kernel, why). Only where this process compiles
    for its own CPU (a TPU/GPU host never builds it), only where it was built, int8 only. With
    `build=False` nothing is built: None while the kernel has not been asked for yet."""
    if jax.default_backend() != "cpu":
        return False, "the native CPU kernel is built only where the CPU is the default backend"
    if not native_cpu.supports(w_dtype):
        return False, f"{jnp.dtype(w_dtype).name} weights: the native CPU kernel reads int8 only"
    return native_cpu.available() if build else native_cpu.status()


def quantized_matmul_implementation(platform: str, w_dtype=jnp.int8) -> str:
    """What `backend="auto"` runs for `w_dtype` weights in a program compiled for `platform`
    ("cpu" | "tpu" | "gpu" | "cuda"), for the engine's log: "native: ..." or "reference: ..."."""
    if platform == "cpu":  # asks, never builds (the dispatch builds on first use)
        ok, why = _native_cpu_choice(w_dtype, build=False)
        return f"native: {why}" if ok or ok is None else f"reference: XLA dot on a converted weight ({why})"
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return "reference: XLA dot with the weight's conversion fused into its operand"
    raise ValueError(f"unknown platform {platform!r}")


def quantized_matmul(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N] int8 / float8, or [L, K, N] with `layer`
    scale: jax.Array,  # [N] f32, or [L, N] with `layer`
    *,
    layer: jax.Array | int | None = None,  # int32 scalar: which stacked layer
    backend: str = "auto",
    precision: str = "highest",
    transposed: bool = False,
    residual: jax.Array | None = None,  # [M, N], x.dtype
    rows: jax.Array | int | None = None,  # int32 scalar: the live rows of x (None: all)
    glu: str | None = None,  # "silu": the gated activation of the result, [M, N / 2]
) -> jax.Array:  # [M, N] (or [M, N / 2] with glu), x.dtype
    """`(x @ w) * scale` with f32 accumulation (see reference.py for the contract).

    backend: "auto" (the best path of the platform the program is compiled for: on CPU the
    native kernel (cpu.py) for int8 weights where it could be built, else the reference; on
    TPU/GPU the reference, whose weight conversion XLA fuses into the dot's operand; see
    `quantized_matmul_implementation`), "cpu" (the native CPU kernel; int8 weights, raises
    where it cannot be built), "reference" (the oracle).
    precision: "highest" (f32 x as given) or "bf16" (x rounded to bf16 before the products,
    f32 sums: on CPU the kernel's bf16 dot-product path for more than 4 rows, about twice
    the f32 rate; relative error up to 2^-9 of the sum of |terms| on top of the weights'
    quantization). bf16 x is the same under both.
    transposed: w is [N, K] (a row per output channel, unstacked): a tied embedding used as
    the LM head, read where it lies rather than through a transposed copy.
    residual: added to the result (`residual + out`, the same bits): a skip connection, which
    the native CPU kernel adds in its epilogue instead of a separate pass over [M, N].
    rows: how many of x's rows are live (a padded batch's real tokens, traced). Rows at and
    past it are don't-care: the native CPU kernel skips their work and writes 0 there; the
    reference (and so every TPU/GPU program) computes them as usual. Live rows are the same
    bits either way.
    glu: "silu" gives a gated MLP's activation of the result instead (silu(gate) * up of its
    two halves, computed in f32 from the result as rounded to x's dtype: reference.py), which
    the native CPU kernel computes in its epilogue (the [M, N] product is never written).
    """
    _validate(x, w, scale, layer, transposed, residual, rows)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if precision not in native_cpu.PRECISIONS:
        raise ValueError(f"precision must be one of {native_cpu.PRECISIONS}, got {precision!r}")
    check_glu(glu, w.shape[-2] if transposed else w.shape[-1], residual, transposed)
    kw = {"precision": precision, "transposed": transposed, "glu": glu}
    if backend == "reference":
        return quantized_matmul_reference(x, w, scale, layer, residual=residual, **kw)
    if backend == "cpu":
        return native_cpu.quantized_matmul_cpu(x, w, scale, layer, residual=residual, rows=rows, **kw)
    # The layer (a traced index inside the layer scan) and the residual travel as operands of
    # every branch.
    stacked = layer is not None
    index = jnp.asarray(layer if stacked else 0, jnp.int32).reshape(())
    live = jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())
    operands = (x, w, scale, index, live) + (() if residual is None else (residual,))

    def reference(x, w, scale, index, live, *res):
        return quantized_matmul_reference(x, w, scale, index if stacked else None, residual=_one(res), **kw)

    def native(x, w, scale, index, live, *res):
        return native_cpu.quantized_matmul_cpu(x, w, scale, index if stacked else None, residual=_one(res),
                                               rows=live, **kw)

    return by_target_platform(operands, reference=reference, tpu=None, gpu=None,
                              cpu=native if _native_cpu_choice(w.dtype)[0] else None)


def _one(xs: tuple) -> jax.Array | None:
    return xs[0] if xs else None
