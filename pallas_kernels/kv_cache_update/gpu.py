"""KV-cache update for NVIDIA GPUs: a Triton kernel (Pallas) scattering rows in place.

Grid (token block, KV head): a program loads `block_t` new rows of one head ([Bt, D]) and
stores each at its slot's row of the cache viewed as [P * ps * Hkv, D]. The cache is
aliased input -> output, so nothing else of it is touched (under jit with a donated or
scan-carried cache, XLA keeps it in place). A head dim that is not a power of two moves as
power-of-two column pieces, like the attention kernel's.

Quantized pages: the wrapper's caller (`ops.update_kv_cache`) quantizes the rows
(`kv_quant`); the kernel stores the values like any rows and each row's f32 scale into the
scales viewed as `[P * ps * Hkv]` (same row index), both aliased in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.gpu import head_dim_pieces, supports


def _kernel(
    slots_ref,
    k_new_ref,
    v_new_ref,
    *refs,  # (k_in, v_in, k_out, v_out), or quantized: (ks_new, vs_new, k_in, v_in, ks_in, vs_in, k_out,
    # v_out, ks_out, vs_out)
    block_t: int,
    num_kv_heads: int,
    pieces: tuple[tuple[int, int], ...],
    quantized: bool,
):
    t0, h = pl.program_id(0) * block_t, pl.program_id(1)
    slots = slots_ref[pl.ds(t0, block_t)]  # [Bt]
    rows = slots * num_kv_heads + h  # [Bt]
    if quantized:  # inputs 2..5 are aliased with the outputs
        ks_new_ref, vs_new_ref, _, _, _, _, k_out_ref, v_out_ref, ks_out_ref, vs_out_ref = refs
        ks_out_ref[rows] = ks_new_ref[pl.ds(t0, block_t), h]
        vs_out_ref[rows] = vs_new_ref[pl.ds(t0, block_t), h]
    else:
        _, _, k_out_ref, v_out_ref = refs  # inputs aliased with the outputs
    for off, w in pieces:
        cols = pl.ds(off, w)
        k_out_ref[rows, cols] = k_new_ref[pl.ds(t0, block_t), h, cols].astype(k_out_ref.dtype)
        v_out_ref[rows, cols] = v_new_ref[pl.ds(t0, block_t), h, cols].astype(v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def update_kv_cache_gpu(
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32
    k_scales: jax.Array | None = None,  # quantized pages: [num_pages, page_size, Hkv] f32
    v_scales: jax.Array | None = None,
    k_new_scales: jax.Array | None = None,  # [T, Hkv] f32, the scales of the (quantized) new rows
    v_new_scales: jax.Array | None = None,
    *,
    block_t: int = 16,
    interpret: bool = False,
):
    """Write the new K/V rows into their slots; padding tokens must point at page 0.
    Quantized pages: k_new / v_new hold quantized values, their scales are written too, and
    the result is (k_pages, v_pages, k_scales, v_scales)."""
    num_tokens, num_kv_heads, head_dim = k_new.shape
    if not supports(head_dim):
        raise ValueError(f"the GPU KV-update kernel needs head_dim in [16, 256], a multiple of 16; got {head_dim}")
    shape = k_pages.shape
    pad = -num_tokens % block_t
    # Extra rows go to slot 0 (null page), so the kernel needs no masks.
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, pad))
    k_new = jnp.pad(k_new, ((0, pad), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new, ((0, pad), (0, 0), (0, 0)))
    rows = (-1, head_dim)  # [P * ps * Hkv, D]
    num_rows = shape[0] * shape[1] * num_kv_heads
    quantized = k_scales is not None
    out_shape = [jax.ShapeDtypeStruct((num_rows, head_dim), k_pages.dtype),
                 jax.ShapeDtypeStruct((num_rows, head_dim), v_pages.dtype)]
    operands = [slots, k_new, v_new]
    if quantized:
        operands += [jnp.pad(x.astype(jnp.float32), ((0, pad), (0, 0))) for x in (k_new_scales, v_new_scales)]
        out_shape += [jax.ShapeDtypeStruct((num_rows,), jnp.float32)] * 2
    first = len(operands)
    operands += [k_pages.reshape(rows), v_pages.reshape(rows)]
    if quantized:
        operands += [k_scales.reshape(-1).astype(jnp.float32), v_scales.reshape(-1).astype(jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, num_kv_heads=num_kv_heads, pieces=head_dim_pieces(head_dim),
                          quantized=quantized),
        grid=((num_tokens + pad) // block_t, num_kv_heads),
        out_shape=tuple(out_shape),
        input_output_aliases={first + i: i for i in range(len(out_shape))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="update_kv_cache_gpu",
    )(*operands)
    if quantized:
        return outs[0].reshape(shape), outs[1].reshape(shape), outs[2].reshape(k_scales.shape), \
            outs[3].reshape(v_scales.shape)
    return outs[0].reshape(shape), outs[1].reshape(shape)
