"""Trace-time shape/dtype checks (Python on static shapes only: zero runtime cost)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def check_shape(name: str, x, expected: Sequence[int | None], meaning: str) -> None:
    """Raise ValueError unless `x.shape` matches `expected` (None = any size)."""
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = ", ".join("?" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must have shape {meaning} = [{want}], got {list(shape)}")


def check_matmul_operands(x, w, layer, transposed: bool, residual, rows=None) -> None:
    """The layouts the CPU matmuls (quantized and dense) take: x [M, K]; w [K, N], stacked
    [L, K, N] with a layer index, or [N, K] when `transposed` (no layer); residual [M, N];
    rows an integer scalar (the live rows of x). Dtypes are each caller's."""
    check_shape("x", x, (None, None), "[M, K]")
    if rows is not None and (jnp.ndim(rows) != 0 or not jnp.issubdtype(jnp.result_type(rows), jnp.integer)):
        raise ValueError(f"rows must be an integer scalar (the live rows of x), got {rows!r}")
    k = x.shape[1]
    if transposed:
        if layer is not None:
            raise ValueError("transposed takes an unstacked w [N, K] (no layer)")
        check_shape("w", w, (None, k), "[N, K] (transposed)")
    elif layer is None:
        check_shape("w", w, (k, None), "[K, N]")
    else:
        check_shape("w", w, (None, k, None), "[L, K, N] (stacked, with layer)")
    if residual is not None:
        check_shape("residual", residual, (x.shape[0], w.shape[0] if transposed else w.shape[-1]), "[M, N]")


def check_int32(name: str, x) -> None:
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (float32/bfloat16), got {x.dtype}")


def check_kv_dtypes(k_pages, v_pages) -> None:
    """Pages are float (f32/bf16) or quantized (int8, float8_e4m3fn, float8_e5m2), K and V alike."""
    from pallas_kernels import kv_quant

    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not (jnp.issubdtype(x.dtype, jnp.floating) or kv_quant.is_quantized(x.dtype)):
            raise ValueError(f"{name} must be float32/bfloat16 or a quantized KV dtype "
                             f"(int8, float8_e4m3fn, float8_e5m2), got {x.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")


def check_scales(k_pages, k_scales, v_scales, num_kv_heads: int) -> None:
    """Scales are given iff the pages are quantized, f32, of `kv_layout.kv_scales_shape`."""
    from pallas_kernels import kv_quant
    from pallas_kernels.kv_layout import kv_scales_shape, layout_of

    quantized = kv_quant.is_quantized(k_pages.dtype)
    given = (k_scales is not None, v_scales is not None)
    if quantized and not all(given):
        raise ValueError(f"pages of dtype {k_pages.dtype} are quantized: pass k_scales and v_scales "
                         "(f32, kv_layout.kv_scales_shape(...))")
    if not quantized and any(given):
        raise ValueError(f"k_scales / v_scales are for quantized pages (int8, float8_e4m3fn, float8_e5m2); "
                         f"the pages are {k_pages.dtype}")
    if not quantized:
        return
    layout = layout_of(k_pages)
    num_pages, page_size = k_pages.shape[:2]
    expected = kv_scales_shape(num_pages, page_size, num_kv_heads, layout)
    meaning = "[num_pages, page_size, Hkv]" if layout == "heads" else "[Hkv, ceil(num_pages * page_size / 128), 128]"
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        check_shape(name, x, expected, f"{meaning} ({layout} layout)")
        if x.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32, got {x.dtype}")
