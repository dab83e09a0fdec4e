"""Pure-jnp KV-cache update: one scatter per cache, the fallback on every backend."""

from __future__ import annotations

import jax


def update_kv_cache_reference(
    k_new: jax.Array,  # [T, *row]: [T, Hkv, D], or [T, C] for the lanes layout
    v_new: jax.Array,  # [T, *row]
    k_pages: jax.Array,  # [num_pages, page_size, *row]
    v_pages: jax.Array,  # [num_pages, page_size, *row]
    slot_mapping: jax.Array,  # [T] int32, slot = page * page_size + offset
) -> tuple[jax.Array, jax.Array]:
    """Write each token's K/V row into its cache slot.

    Padding tokens point at slots of the null page 0, so every index is in bounds and no
    masking is needed; their writes collide there harmlessly. Under jit with a donated (or
    scan-carried) cache, XLA performs the scatter in place.
    """
    num_pages, page_size, *row = k_pages.shape
    flat = (num_pages * page_size, *row)
    slots = slot_mapping.astype("int32")
    k_out = (
        k_pages.reshape(flat).at[slots].set(k_new.astype(k_pages.dtype), mode="promise_in_bounds")
    )
    v_out = (
        v_pages.reshape(flat).at[slots].set(v_new.astype(v_pages.dtype), mode="promise_in_bounds")
    )
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
