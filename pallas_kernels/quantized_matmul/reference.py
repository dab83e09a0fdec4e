"""Weight-quantized matmul, the contract as pure jnp (the oracle).

    out[m, n] = (sum_k x[m, k] * w[k, n]) * scale[n]

`w` holds int8 or float8 values, `scale` one f32 factor per output channel. The products are
summed in f32 and the result is cast to `x.dtype`. With `layer` given, `w` and `scale` are
stacked over layers ([L, K, N], [L, N]) and layer `layer` (an int32 scalar, traced inside
the layer scan) is used, so an implementation can read the weight where it lies instead of
taking a copy of the slice.

`precision="bf16"` rounds x to bf16 before the products (still f32 sums, output in x's
dtype): the products of a bf16 activation and an int8 (or float8) weight are exact in f32, so
this is what a bf16 dot-product instruction computes. "highest" (the default) keeps f32 x.

`residual` ([M, N], x's dtype) is added to the result (rounded to x's dtype first), as
`residual + quantized_matmul(...)` would: a layer's skip connection, which the native CPU
kernel folds into its epilogue.

`glu="silu"` (w [K, N], no residual) turns the result y [M, N] into a gated MLP's activation
[M, N / 2]: silu(y[:, :N/2]) * y[:, N/2:] computed in f32 from y as rounded to x's dtype,
rounded once (`gated`); the native CPU kernel computes it in its epilogue.

`transposed=True` takes w as [N, K] (a row per output channel: a tied embedding read as the
LM head), unstacked; XLA folds the transposition into the dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GLU_ACTIVATIONS = ("silu",)


def check_glu(glu: str | None, n: int, residual, transposed: bool) -> None:
    """A gated activation's operands: a known activation, an even N, no residual, w [K, N]."""
    if glu is None:
        return
    if glu not in GLU_ACTIVATIONS:
        raise ValueError(f"glu must be one of {GLU_ACTIVATIONS} or None, got {glu!r}")
    if n % 2 or residual is not None or transposed:
        raise ValueError(f"glu={glu!r} takes w [K, N] with an even N ({n}) and no residual")


def gated(y: jax.Array, glu: str | None) -> jax.Array:
    """y [M, N] -> act(y[:, :N/2]) * y[:, N/2:] in f32, rounded to y's dtype (y itself for None)."""
    if glu is None:
        return y
    half = y.shape[-1] // 2
    f32 = jnp.float32
    return (jax.nn.silu(y[:, :half].astype(f32)) * y[:, half:].astype(f32)).astype(y.dtype)


def select_layer(w: jax.Array, scale: jax.Array, layer: jax.Array | int | None):
    """The [K, N] weight and [N] scale of `layer` (or the arrays as given when None)."""
    if layer is None:
        return w, scale
    return (jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False),
            jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False))


def quantized_matmul_reference(
    x: jax.Array,  # [M, K] float32 / bfloat16
    w: jax.Array,  # [K, N] int8 / float8 (or [L, K, N] with `layer`)
    scale: jax.Array,  # [N] float32 (or [L, N] with `layer`)
    layer: jax.Array | int | None = None,
    *,
    precision: str = "highest",  # or "bf16": x rounded to bf16 before the products
    transposed: bool = False,  # w [N, K] (unstacked), contracted along its second axis
    residual: jax.Array | None = None,  # [M, N], x.dtype: added to the result
    glu: str | None = None,  # "silu": the gated activation of the result, [M, N / 2]
) -> jax.Array:  # [M, N] (or [M, N / 2] with glu), x.dtype
    check_glu(glu, w.shape[-2] if transposed else w.shape[-1], residual, transposed)
    w, scale = select_layer(w, scale, layer)
    xp = x.astype(jnp.bfloat16) if precision == "bf16" else x
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    acc = jax.lax.dot_general(xp, w.astype(xp.dtype), dims, preferred_element_type=jnp.float32)
    out = (acc * scale.astype(jnp.float32)).astype(x.dtype)
    return gated(out, glu) if residual is None else residual + out
