"""The two page layouts of the paged KV cache, and which one a platform gets.

* ``heads``: a page is ``[S, Hkv, D]`` (CPU and GPU; XLA's row-major layouts there).
* ``lanes``: a page is ``[S, C]``, the token's heads side by side in ``C = Hkv*D`` lanes
  rounded up to the 128-lane vector width (TPU). XLA:TPU keeps such an array row-major
  and unpadded in HBM, so the Mosaic kernels read and write it in place. With the heads
  layout, small (Hkv, D) minor dims made XLA pick a layout with the page axis in the lanes
  (to avoid tile padding) and relayout-copy the whole cache into and out of every step;
  SmolLM2's (3, 64) then needed 2.7x the cache in temporaries (measured with
  `jaxserve compile --target tpu:v5e-1`).

In the lanes layout, head ``h`` occupies lanes ``[h*D, (h+1)*D)``. With ``D < 128`` (D a
divisor of 128) several heads share one 128-lane tile; kernels read the whole aligned tile
and zero the other heads' lanes through the query instead of slicing lanes.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

LANE = 128
KVLayout = Literal["heads", "lanes"]


def lanes_width(num_kv_heads: int, head_dim: int) -> int:
    """C: lanes a token's K (or V) row takes in the lanes layout."""
    return -(-num_kv_heads * head_dim // LANE) * LANE


def lanes_supported(head_dim: int) -> bool:
    """Heads tile the 128 lanes evenly: D divides 128 or 128 divides D."""
    return head_dim > 0 and (LANE % head_dim == 0 or head_dim % LANE == 0)


def head_window(h: int, head_dim: int) -> tuple[int, int, int]:
    """(first lane, width, head offset in it) of the aligned lane window holding head h."""
    if head_dim >= LANE:
        return h * head_dim, head_dim, 0
    start = h * head_dim // LANE * LANE
    return start, LANE, h * head_dim - start


def layout_of(pages: jax.Array) -> KVLayout:
    """`[P, S, C]` is the lanes layout, `[P, S, Hkv, D]` the heads layout."""
    return "lanes" if pages.ndim == 3 else "heads"


def to_lanes(x: jax.Array, width: int) -> jax.Array:
    """`[..., Hkv, D]` rows as `[..., C]` (zero lanes past Hkv*D)."""
    flat = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    pad = width - flat.shape[-1]
    return jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)]) if pad else flat


def to_heads(x: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """`[..., C]` rows as `[..., Hkv, D]` (drops the padding lanes)."""
    return x[..., : num_kv_heads * head_dim].reshape(*x.shape[:-1], num_kv_heads, head_dim)
