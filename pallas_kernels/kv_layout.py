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


def kv_scales_shape(num_pages: int, page_size: int, num_kv_heads: int, layout: KVLayout) -> tuple[int, ...]:
    """Shape of one quantized cache's scales (`k_scales` / `v_scales`, f32, one per token and
    KV head; see `pallas_kernels.kv_quant`) for a pool of `num_pages` pages.

    * heads: ``[num_pages, page_size, Hkv]``, slot s of head h at ``[s // S, s % S, h]``.
    * lanes: ``[Hkv, ceil(num_pages * page_size / 128), 128]``, slot s of head h at
      ``[h, s // 128, s % 128]``: each head's scales in slot order, 128 to a row. XLA:TPU keeps
      it row-major with no padding (a ``[..., S, Hkv]`` or ``[P, S * Hkv]`` f32 array would be
      padded to 128 lanes or relaid out), and the Mosaic kernel DMAs the one row holding a
      page's scales. Pages must not straddle rows for the kernel: S divides 128 or 128
      divides S. It is not a reshape of a per-layer stack: a model that flattens its layers'
      pages into one pool of ``L * num_pages`` pages allocates ``kv_scales_shape(L * num_pages,
      ...)`` directly.

    Under tensor parallelism the scales are split by KV head like the pages: each rank holds
    this shape for its own heads, along `kv_scales_axis_of_heads(layout)`.
    """
    if layout == "lanes":
        return (num_kv_heads, -(-num_pages * page_size // LANE), LANE)
    if layout == "heads":
        return (num_pages, page_size, num_kv_heads)
    raise ValueError(f"layout must be 'heads' or 'lanes', got {layout!r}")


def kv_scales_axis_of_heads(layout: KVLayout) -> int:
    """The axis of `kv_scales_shape(...)` that holds the KV heads (the one to shard under TP)."""
    if layout not in ("heads", "lanes"):
        raise ValueError(f"layout must be 'heads' or 'lanes', got {layout!r}")
    return 0 if layout == "lanes" else 2
