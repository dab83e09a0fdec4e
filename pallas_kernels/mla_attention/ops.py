"""Paged multi-head latent attention: the cache write and the absorbed attention.

The cache holds, per token, one row `[c_kv | k_rope]` of width W = kv_lora_rank +
qk_rope_head_dim (576 for DeepSeek-V3) and nothing per head, in either layout of
`pallas_kernels.kv_layout` with a single KV head: pages `[P, S, 1, W]` (heads: CPU, GPU) or
`[P, S, C]` with C = W rounded up to 128 lanes (lanes: TPU, 640 for W = 576; in the heads
layout XLA:TPU tiles the [1, W] minor dims to [8, 640] and relayouts the cache every step).
Quantized pages (int8 / fp8) carry one f32 scale per token (`kv_scales_shape(P, S, 1, layout)`),
as a GQA cache carries one per token and head.

With the key up-projection absorbed into the query (q_lat = q_nope . W_UK) attention over the
latent is multi-query attention with one 576-wide KV head whose values are the row's first
`latent_dim` lanes: `ragged_paged_attention` reads the same pages as keys and values and the
output keeps the latent lanes ([T, H, kv_lora_rank]; the caller applies W_UV). The values
then span the RoPE lanes too (64 of 576 lanes of extra P.V work) but no second copy of the
cache exists. On CPU the native paged-attention kernel runs it; on TPU the Mosaic kernel, over
the lanes layout with the query padded to the rows' C lanes and smaller blocks (`tpu_blocks`);
on GPU the Triton kernel on float pages where a query block of the shard's heads fits shared
memory (`latent_block_q`: up to 64 query heads per device at 576 lanes), else the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels._dispatch import by_target_platform
from pallas_kernels._validate import check_float, check_int32, check_shape
from pallas_kernels.kv_layout import kv_scales_shape, lanes_width, layout_of
from pallas_kernels.ragged_paged_attention.gpu import latent_block_q, ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.ops import ragged_paged_attention


def update_latent_cache(
    latent: jax.Array,  # [T, W] this step's rows: c_kv then the rotated k_rope
    pages: jax.Array,  # [P, S, 1, W] (heads) or [P, S, C] (lanes)
    slot_mapping: jax.Array,  # [T] int32, slot = page * page_size + offset (padding: page 0)
    scales: jax.Array | None = None,  # quantized pages: kv_scales_shape(P, S, 1, layout) f32
) -> tuple[jax.Array, ...]:
    """Writes each token's latent row into its slot; returns (pages,) or (pages, scales)."""
    check_shape("latent", latent, (None, None), "[T, W]")
    T, W = latent.shape
    layout = layout_of(pages)
    if layout == "lanes":
        check_shape("pages", pages, (None, None, lanes_width(1, W)), f"[num_pages, page_size, C={lanes_width(1, W)}]")
    else:
        check_shape("pages", pages, (None, None, 1, W), f"[num_pages, page_size, 1, W={W}]")
    check_shape("slot_mapping", slot_mapping, (T,), "[T]")
    check_int32("slot_mapping", slot_mapping)
    check_float("latent", latent)
    quantized = kv_quant.is_quantized(pages.dtype)
    if quantized != (scales is not None):
        raise ValueError("scales are required exactly when the pages are quantized "
                         f"(pages {pages.dtype}, scales {'given' if scales is not None else 'missing'})")
    P, S = pages.shape[:2]
    rows = latent
    if quantized:
        want = kv_scales_shape(P, S, 1, layout)
        check_shape("scales", scales, want, str(list(want)))
        rows, row_scales = kv_quant.quantize(latent, pages.dtype)  # [T, W], [T]
        scales = kv_quant.write_scales(scales, slot_mapping, row_scales[:, None], layout)
    width = pages.shape[-1]
    if width != W:  # lanes: zero lanes past W
        rows = jnp.pad(rows, ((0, 0), (0, width - W)))
    flat = pages.reshape(P * S, width)
    flat = flat.at[slot_mapping].set(rows.astype(pages.dtype), mode="promise_in_bounds")
    pages = flat.reshape(pages.shape)
    return (pages,) if scales is None else (pages, scales)


def mla_paged_attention(
    q: jax.Array,  # [T, H, W]: q_nope . W_UK (kv_lora_rank lanes) then the rotated q_rope
    pages: jax.Array,  # [P, S, 1, W] or [P, S, C]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    latent_dim: int,
    scales: jax.Array | None = None,  # quantized pages: kv_scales_shape(P, S, 1, layout) f32
    backend: str = "auto",
    interpret: bool | object = False,
    batch_invariant: bool = False,
) -> jax.Array:  # [T, H, latent_dim] in q's dtype: softmax(q . row) . row[:latent_dim]
    """Absorbed MLA over the paged latent cache (see the module docstring)."""
    check_shape("q", q, (None, None, None), "[T, H, W]")
    if not 0 < latent_dim <= q.shape[-1]:
        raise ValueError(f"latent_dim must be in (0, {q.shape[-1]}], got {latent_dim}")
    kw = {} if scales is None else {"k_scales": scales, "v_scales": scales}
    if layout_of(pages) == "lanes" and backend in ("auto", "pallas_tpu", "pallas"):
        return _lanes(q, pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale, latent_dim=latent_dim,
                      backend=backend, interpret=interpret, **kw)
    plain = functools.partial(ragged_paged_attention, sm_scale=sm_scale, num_kv_heads=1, backend=backend,
                              interpret=interpret, batch_invariant=batch_invariant, **kw)
    args = (q, pages, pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    block_q = latent_block_q(q.shape[-1], q.shape[1])
    # the Triton kernel for wide rows, float pages (its quantized reads are not checked at this width)
    gpu_ok = block_q is not None and scales is None and not batch_invariant
    if gpu_ok and (backend == "pallas_gpu" or (backend == "auto" and not interpret)):
        gpu = functools.partial(ragged_paged_attention_gpu, sm_scale=sm_scale, block_q=block_q,
                                interpret=bool(interpret))
        out = gpu(*args) if backend == "pallas_gpu" else by_target_platform(args, reference=plain, tpu=None, gpu=gpu)
    else:
        out = plain(*args)
    return out[..., :latent_dim]


def tpu_blocks(num_q_heads: int) -> tuple[int, int]:
    """(block_q, chunk_pages) of the Mosaic kernel for latent rows: a query block of at most
    1024 head-rows (8 tokens at 128 heads, 32 at 32 heads or fewer) and one page per KV chunk,
    which keep its VMEM scratch within the scoped limit at 640 lanes (the default 32-token
    blocks ran out of VMEM at 128 heads on v5e and v6e; compile-only)."""
    block_q = 8
    while block_q < 32 and 2 * block_q * num_q_heads <= 1024:
        block_q *= 2
    return block_q, 1


def _lanes(q, pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, latent_dim, backend, interpret,
           **scales):
    """Latent rows in the lanes layout (TPU): the query padded with zero lanes to the rows' C
    lanes, the Mosaic kernel (`ragged_paged_attention_tpu`, one KV head of C lanes) where the
    program is compiled for a TPU, the reference elsewhere."""
    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
    from pallas_kernels.ragged_paged_attention.tpu import (
        ragged_paged_attention_tpu,
        scales_page_size_ok,
    )

    width = pages.shape[-1]
    if q.shape[-1] > width:
        raise ValueError(f"q has {q.shape[-1]} lanes, the latent rows {width}")
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, width - q.shape[-1]))) if q.shape[-1] < width else q
    args = (qp, pages, pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    block_q, chunk_pages = tpu_blocks(q.shape[1])
    kernel = functools.partial(ragged_paged_attention_tpu, num_kv_heads=1, sm_scale=sm_scale, block_q=block_q,
                               chunk_pages=chunk_pages, **scales)
    fits = width % 128 == 0 and (not scales or scales_page_size_ok(pages.shape[1]))
    if backend == "auto" and not interpret:
        reference = functools.partial(ragged_paged_attention_reference, num_kv_heads=1, sm_scale=sm_scale, **scales)
        out = by_target_platform(args, reference=reference, tpu=kernel if fits else None, gpu=None)
    else:
        if not fits:
            raise ValueError(f"the Mosaic kernel takes latent rows of a multiple of 128 lanes (got {width}) and, "
                             "with quantized pages, page sizes that divide 128 or are multiples of it")
        out = kernel(*args, interpret=interpret)
    return out[..., :latent_dim]


def mla_attention_expanded(
    q_nope: jax.Array,  # [T, H, dn]
    q_rope: jax.Array,  # [T, H, dr], rotated
    c_kv: jax.Array,  # [C, Dl] the context's latents (the T queries are its last T tokens)
    k_rope: jax.Array,  # [C, dr], rotated
    kv_b: jax.Array,  # [Dl, H, dn + dv]: W_UK then W_UV per head
    *,
    sm_scale: float,
) -> jax.Array:  # [T, H, dv]
    """MLA as transformers computes it, one causal sequence: the latent expanded to per-head
    keys and values, then plain attention. The oracle of the absorbed form, and the expanded
    alternative `scripts/bench_mla.py` measures."""
    T, H, dn = q_nope.shape
    C = c_kv.shape[0]
    kv = jnp.einsum("cl,lhe->che", c_kv.astype(jnp.float32), kv_b.astype(jnp.float32))  # [C, H, dn+dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = (jnp.einsum("thd,chd->htc", q_nope.astype(jnp.float32), k_nope)
              + jnp.einsum("thd,cd->htc", q_rope.astype(jnp.float32), k_rope.astype(jnp.float32))) * sm_scale
    causal = jnp.arange(C)[None, :] <= (C - T + jnp.arange(T))[:, None]  # [T, C]
    p = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("htc,che->the", p, v).astype(q_nope.dtype)
