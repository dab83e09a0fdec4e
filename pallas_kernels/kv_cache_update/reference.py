"""Pure-jnp KV-cache update: one scatter per cache, the fallback on every backend."""

from __future__ import annotations

import jax

from pallas_kernels import kv_quant
from pallas_kernels.kv_layout import layout_of, to_lanes


def _scatter_rows(pages: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    num_pages, page_size, *row = pages.shape
    flat = pages.reshape(num_pages * page_size, *row)
    return flat.at[slots].set(rows.astype(pages.dtype), mode="promise_in_bounds").reshape(pages.shape)


def quantize_new_rows(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array):
    """k_new, v_new [T, Hkv, D] -> (values in the pages' dtype and layout ([T, Hkv, D] or
    [T, C]), their scales [T, Hkv] f32), for K and V: (k_vals, v_vals, k_sc, v_sc)."""
    dtype = k_pages.dtype
    (kq, ks), (vq, vs) = kv_quant.quantize(k_new, dtype), kv_quant.quantize(v_new, dtype)
    if k_pages.ndim == 3:  # lanes layout
        kq, vq = to_lanes(kq, k_pages.shape[2]), to_lanes(vq, k_pages.shape[2])
    return kq, vq, ks, vs


def update_kv_cache_reference(
    k_new: jax.Array,  # [T, *row]: [T, Hkv, D], or [T, C] for the lanes layout
    v_new: jax.Array,  # [T, *row]
    k_pages: jax.Array,  # [num_pages, page_size, *row]
    v_pages: jax.Array,  # [num_pages, page_size, *row]
    slot_mapping: jax.Array,  # [T] int32, slot = page * page_size + offset
    k_scales: jax.Array | None = None,  # quantized pages: kv_layout.kv_scales_shape(...) f32
    v_scales: jax.Array | None = None,
):
    """Write each token's K/V row into its cache slot.

    Padding tokens point at slots of the null page 0, so every index is in bounds and no
    masking is needed; their writes collide there harmlessly. Under jit with a donated (or
    scan-carried) cache, XLA performs the scatter in place.

    Quantized pages (int8 / fp8, `kv_quant`): pass the scales; the new rows, `[T, Hkv, D]` in
    either layout, are quantized per token and head, and values and scales are written;
    returns (k_pages, v_pages, k_scales, v_scales). Otherwise (k_pages, v_pages).
    """
    slots = slot_mapping.astype("int32")
    if k_scales is None:
        return _scatter_rows(k_pages, slots, k_new), _scatter_rows(v_pages, slots, v_new)
    kq, vq, ks, vs = quantize_new_rows(k_new, v_new, k_pages)
    layout = layout_of(k_pages)
    return (_scatter_rows(k_pages, slots, kq), _scatter_rows(v_pages, slots, vq),
            kv_quant.write_scales(k_scales, slots, ks, layout), kv_quant.write_scales(v_scales, slots, vs, layout))
