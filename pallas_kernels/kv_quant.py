"""Quantized KV-cache pages: the dtypes, the per-token-per-head math, and where scales live.

A quantized cache holds K and V values in int8, float8_e4m3fn or float8_e5m2, and one f32
scale per token per KV head in separate arrays (`k_scales`, `v_scales`; shape from
`kv_layout.kv_scales_shape`). The KV-update op quantizes dynamically, per token and head:

    amax  = max |x| over D
    scale = amax / qmax            (int8: 127, e4m3: 448, e5m2: 57344); 1.0 where amax == 0
    value = round_half_even(x / scale) clipped to [-127, 127]   (int8)
          = (x / scale) clipped to [-qmax, qmax], cast           (fp8, round to nearest even)

and every attention implementation reads `value * scale` (the dequantized row). The clip
is a no-op for fp8 up to the f32 rounding of x / scale (it keeps e4m3fn, which has no
infinity, from turning an amax row into NaN).

Every implementation and the tests use these functions, so the math exists once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_layout import LANE, KVLayout

# The engine's names (`kv_cache_dtype`) and the page dtypes they stand for.
KV_CACHE_DTYPES = {
    "int8": jnp.dtype(jnp.int8),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e5m2": jnp.dtype(jnp.float8_e5m2),
}
_QMAX = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
}
QUANTIZED_DTYPES = tuple(_QMAX)


def kv_cache_dtype(name_or_dtype) -> jnp.dtype:
    """The page dtype of a `kv_cache_dtype` name ("int8", "fp8_e4m3", "fp8_e5m2") or of a dtype."""
    if isinstance(name_or_dtype, str) and name_or_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name_or_dtype]
    try:
        return jnp.dtype(name_or_dtype)
    except TypeError as e:
        raise ValueError(f"unknown KV-cache dtype {name_or_dtype!r}; quantized ones are "
                         f"{sorted(KV_CACHE_DTYPES)}") from e


def is_quantized(dtype) -> bool:
    """Whether pages of this dtype hold quantized values (and need scales)."""
    return jnp.dtype(dtype) in _QMAX


def qmax(dtype) -> float:
    """Largest magnitude a quantized value takes (the scale maps amax onto it)."""
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"{dtype} is not a quantized KV-cache dtype ({', '.join(d.name for d in _QMAX)})")
    return _QMAX[dtype]


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] (any float) -> (values [..., D] in `dtype`, scales [...] f32), per row."""
    dtype = jnp.dtype(dtype)
    q = qmax(dtype)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax == 0.0, jnp.float32(1.0), amax / jnp.float32(q))
    y = jnp.clip(xf / scale[..., None], -q, q)
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """values [..., D] * scales [...] -> [..., D] in `dtype` (the math in f32)."""
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)


# ------------------------------------------------------------------ where the scales live
#
# heads layout: [num_pages, page_size, Hkv]; slot s, head h at [s // S, s % S, h].
# lanes layout: [Hkv, ceil(num_pages * page_size / 128), 128]; slot s, head h at
#               [h, s // 128, s % 128] (each head's scales in slot order, 128 per row).


def scales_at(scales: jax.Array, slots: jax.Array, layout: KVLayout) -> jax.Array:
    """The scales of `slots` ([...] int32): [..., Hkv] f32."""
    if layout == "lanes":
        out = scales[:, slots // LANE, slots % LANE]  # [Hkv, ...]
        return jnp.moveaxis(out, 0, -1)
    num_pages, page_size, num_kv_heads = scales.shape
    return scales.reshape(num_pages * page_size, num_kv_heads)[slots]


def write_scales(scales: jax.Array, slots: jax.Array, new: jax.Array, layout: KVLayout) -> jax.Array:
    """Scatter `new` [T, Hkv] into the rows of `slots` [T] (padding tokens hit the null page)."""
    new = new.astype(scales.dtype)
    if layout == "lanes":
        heads = jnp.arange(scales.shape[0], dtype=jnp.int32)[:, None]  # [Hkv, 1]
        return scales.at[heads, (slots // LANE)[None, :], (slots % LANE)[None, :]].set(
            new.T, mode="promise_in_bounds")
    num_pages, page_size, num_kv_heads = scales.shape
    flat = scales.reshape(num_pages * page_size, num_kv_heads)
    return flat.at[slots].set(new, mode="promise_in_bounds").reshape(scales.shape)


def page_scales(scales: jax.Array, pages: jax.Array, page_size: int, layout: KVLayout) -> jax.Array:
    """The scales of whole pages ([...] int32 page ids): [..., page_size, Hkv] f32."""
    if layout == "heads":  # whole pages as rows of a 2-D view (block tables hold valid ids)
        num_pages, _, num_kv_heads = scales.shape
        rows = scales.reshape(num_pages, page_size * num_kv_heads).at[pages].get(mode="promise_in_bounds")
        return rows.reshape(*pages.shape, page_size, num_kv_heads)
    slots = pages[..., None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
    return scales_at(scales, slots, layout)


def quantize_numpy(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """`quantize` on host arrays (tests, benchmarks): the same jnp math, one jitted call."""
    values, scales = _quantize_jit(jnp.asarray(x), jnp.dtype(dtype))
    return np.asarray(values), np.asarray(scales)


_quantize_jit = jax.jit(quantize, static_argnums=1)
